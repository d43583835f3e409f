"""Publishing trained weights to the inference servers; ``Platform.weight_sync_method`` picks the way.

``skyrl``: SkyRL moves weights into its vLLM servers itself (NCCL broadcast or CUDA IPC) through
``WorkerDispatch.save_weights_for_sampler``, once the dispatch knows the servers' client.
``disk``: SkyRL has no from-disk path for full weights and its transfer needs vLLM, so the workers
save HF weights and every server reloads them from that directory (``POST
/rllm_skyrl/v1/load_weights``, an endpoint of this package's CPU server).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any


def prepare(method: str, workers: Any, client: Any) -> None:
    """Connect SkyRL's weight transfer to the servers once, when it is the method in use."""
    if method == "skyrl":
        workers.connect_inference(client)


async def sync_weights(method: str, workers: Any, servers: Any, sync_dir: Path, version: int) -> None:
    """Make every server sample from the workers' current policy."""
    if method == "skyrl":
        await workers.save_weights_for_sampler()
        return
    if method != "disk":
        raise ValueError(f"unknown weight sync method {method!r}; expected 'skyrl' or 'disk'")
    await asyncio.to_thread(_save_and_reload, workers, servers, Path(sync_dir), version)


def _save_and_reload(workers: Any, servers: Any, target: Path, version: int) -> None:
    """Blocking (Ray and HTTP): runs off the event loop so rollouts go on meanwhile."""
    shutil.rmtree(target, ignore_errors=True)
    workers.save_hf_model("policy", str(target))
    servers.load_weights(str(target.resolve()), weight_version=version)
