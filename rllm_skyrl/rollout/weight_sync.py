"""Publishing trained weights to the inference servers; ``Platform.weight_sync_method`` picks the way.

``skyrl``: SkyRL moves weights into its vLLM servers itself (NCCL broadcast or CUDA IPC; a LoRA
adapter through ``lora_sync_path``) in ``WorkerDispatch.save_weights_for_sampler``.
``lora``: a LoRA policy on CPU, where that call cannot run (its set-up builds the GPU transfer):
the policy workers' own ``broadcast_to_inference_engines`` writes the adapter and asks every server
to load it (``POST /skyrl/v1/load_lora_adapter``), as SkyRL does for vLLM.
``disk``: SkyRL has no from-disk path for full weights and its transfer needs vLLM, so the workers
save HF weights and every server reloads them (``POST /rllm_skyrl/v1/load_weights``, our CPU server's).

A LoRA policy is served under SkyRL's adapter name (``resolve_policy_model_name``), which the
servers only know once an adapter was loaded: the backend syncs before the first rollout.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any


def prepare(method: str, workers: Any, client: Any) -> None:
    if method == "skyrl":
        workers.connect_inference(client)


async def sync_weights(
    method: str, workers: Any, servers: Any, sync_dir: Path, version: int, lora_sync_path: str | None = None
) -> int | None:
    """Make every server sample from the workers' current policy; returns the bytes written for the
    servers to read (None when SkyRL moves them itself)."""
    if method == "skyrl":
        await workers.save_weights_for_sampler()
        return None
    if method == "lora":
        if not lora_sync_path:
            raise ValueError("the lora weight sync needs trainer.policy.model.lora.lora_sync_path")
        return await asyncio.to_thread(_publish_adapter, workers, servers.urls, Path(lora_sync_path))
    if method != "disk":
        raise ValueError(f"unknown weight sync method {method!r}; expected 'skyrl', 'lora' or 'disk'")
    return await asyncio.to_thread(_save_and_reload, workers, servers, Path(sync_dir), version)


def _publish_adapter(workers: Any, urls: list[str], target: Path) -> int:
    """Blocking (Ray and HTTP): SkyRL's worker writes the adapter into ``target`` and the servers load it."""
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient

    # A control-plane client of the servers: no tokenizer, so it is cheap to ship to the workers.
    client = RemoteInferenceClient(
        proxy_url=urls[0], server_urls=list(urls), data_parallel_size=1, uses_lora_weight_sync=True
    )
    workers.broadcast_to_inference_engines(client)
    return directory_bytes(target)


def _save_and_reload(workers: Any, servers: Any, target: Path, version: int) -> int:
    """Blocking (Ray and HTTP): runs off the event loop so rollouts go on meanwhile."""
    shutil.rmtree(target, ignore_errors=True)
    workers.save_hf_model("policy", str(target), with_tokenizer=False)  # servers read weights only
    servers.load_weights(str(target.resolve()), weight_version=version)
    return directory_bytes(target)


def directory_bytes(path: Path) -> int:
    """Bytes of every file under ``path``: what a server reads to take the new weights."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
