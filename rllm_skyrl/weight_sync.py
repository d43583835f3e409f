"""Publishing trained weights to the inference servers.

On CUDA, SkyRL moves weights into its vLLM servers itself (NCCL broadcast or CUDA IPC) through
``WorkerDispatch.save_weights_for_sampler``. SkyRL has no from-disk path for full weights and its
paths need vLLM, so without CUDA the workers save HF weights and every server reloads them from
that directory (``POST /rllm_skyrl/v1/load_weights``, an endpoint of our CPU server).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rllm_skyrl.compat import cpu


def sync_method(cuda_available: bool) -> str:
    """``"skyrl"`` (SkyRL's in-memory transfer to vLLM) or ``"disk"`` (HF save + server reload)."""
    return "skyrl" if cuda_available else "disk"


def prepare(workers: Any, engine: Any) -> None:
    """Connect SkyRL's weight transfer to the servers once, when it is the method in use."""
    if sync_method(cpu.cuda_available()) == "skyrl":
        workers.dispatch.init_weight_sync_state(engine.client)


async def sync_weights(workers: Any, servers: Any, sync_dir: Path, version: int) -> str:
    """Make every server sample from the workers' current policy; returns the method used."""
    method = sync_method(cpu.cuda_available())
    if method == "skyrl":
        await workers.dispatch.save_weights_for_sampler()
        return method
    target = Path(sync_dir)
    shutil.rmtree(target, ignore_errors=True)
    workers.save_hf_model("policy", str(target))
    servers.load_weights(str(target.resolve()), weight_version=version)
    return method
