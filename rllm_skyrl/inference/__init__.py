"""A CPU inference server (HF transformers + FastAPI) speaking SkyRL's inference HTTP protocol.

SkyRL's own ``RemoteInferenceClient`` drives it as it drives SkyRL's vLLM servers, so the rollout
path is the same on a laptop and on a GPU cluster. Full-weight sync, which SkyRL only does over
vLLM/NCCL, goes through ``POST /rllm_skyrl/v1/load_weights``.

Names load their modules on first use: the driver imports this package for ``middleware.TOKEN_ENV``
and should not pay for torch and transformers before its start-up can begin.
"""

import importlib

_EXPORTS = {
    "GenerationResult": "generation_request",
    "InferenceServer": "http_server",
    "InferenceService": "served_model",
    "SamplingParams": "sampling",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
