"""A CPU inference server (HF transformers + FastAPI) speaking SkyRL's inference HTTP protocol.

SkyRL's own ``RemoteInferenceClient`` drives it exactly as it drives SkyRL's vLLM servers, so the
rollout path is the same on a laptop and on a GPU cluster. Full-weight sync, which SkyRL only
does over vLLM/NCCL, goes through ``POST /rllm_skyrl/v1/load_weights``.
"""

from rllm_skyrl.inference.sampling import SamplingParams
from rllm_skyrl.inference.scheduler import GenerationResult
from rllm_skyrl.inference.server import InferenceServer
from rllm_skyrl.inference.service import InferenceService

__all__ = ["GenerationResult", "InferenceServer", "InferenceService", "SamplingParams"]
