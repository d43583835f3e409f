"""CPU or CUDA, decided once per run: which servers roll out, how weights reach them, what Ray offers.

flash-attn is optional on CUDA (PyPI has no wheels for it): without it SkyRL trains with sdpa.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any

# Logical GPUs offered on a CPU-only machine: enough for policy, critic and ref at data-parallel
# size 2 each. They only gate scheduling; nothing runs on them.
CPU_LOGICAL_GPUS = 8

# SkyRL config values that must hold without flash-attn: sdpa attention, and no unpadded
# (varlen-packed) micro-batches, which SkyRL only implements with flash-attn's kernels.
NO_FLASH_ATTN_CONFIG: dict[str, object] = {
    "trainer.flash_attn": False,
    "trainer.remove_microbatch_padding": False,
}
# SkyRL config values that must hold on CPU: colocation relies on CUDA IPC and memory offload;
# dataloader workers would fork Ray-initialised state.
CPU_CONFIG: dict[str, object] = {
    "trainer.placement.colocate_all": False,
    "trainer.placement.colocate_policy_ref": False,
    "trainer.use_expandable_segments": False,
    "data.dataloader.num_workers": 0,
}


def has_nvidia_driver() -> bool:
    """Whether this machine could have CUDA, asked without importing torch."""
    return any(os.path.exists(path) for path in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg"))


def cpu_threads(share: int = 1) -> int:
    """Torch threads for each of ``share`` processes that split this process's cores: the cores it may
    run on (taskset, a container's cpuset), not the machine's; at most ``OMP_NUM_THREADS`` where that
    is set, the limit a user or a scheduler puts on each process's threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // share)
    limit = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(limit)) if limit.isdigit() and int(limit) > 0 else threads


def flash_attn_installed() -> bool:
    """Whether the real flash-attn is installed (an import stub, having no file, does not count)."""
    module = sys.modules.get("flash_attn")
    if module is not None:
        return getattr(module, "__file__", None) is not None
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and spec.origin is not None


@dataclass(frozen=True)
class Platform:
    """Where a run trains and serves. ``cuda=False`` means SkyRL's workers run on CPU (gloo)."""

    cuda: bool
    flash_attn: bool = False

    @classmethod
    def detect(cls) -> Platform:
        """This machine: CUDA if torch sees a GPU; flash-attn if it is installed (never used on CPU)."""
        import torch  # imported here: a launcher starting Ray need not pay for it

        cuda = torch.cuda.is_available()
        return cls(cuda=cuda, flash_attn=cuda and flash_attn_installed())

    @classmethod
    def gpu_cluster(cls) -> Platform:
        """The platform ``rllm-skyrl plan`` describes from any machine: CUDA with flash-attn."""
        return cls(cuda=True, flash_attn=True)

    def server_kind(self, urls: list[str] | tuple[str, ...] | None) -> str:
        """Given URLs, else SkyRL's vLLM servers on CUDA, else this package's CPU servers."""
        if urls:
            return "external"
        return "skyrl_vllm" if self.cuda else "cpu_transformers"

    def weight_sync_method(self, lora: bool = False) -> str:
        """``skyrl`` (``save_weights_for_sampler``, SkyRL's transfer into vLLM) on CUDA.

        On CPU that call cannot run (its set-up needs vLLM): a LoRA policy takes SkyRL's adapter sync
        directly (``lora``: the worker writes the adapter and every server loads it), full weights go
        through ``disk`` (HF save, then the server's reload endpoint: SkyRL has no from-disk path).
        """
        if self.cuda:
            return "skyrl"
        return "lora" if lora else "disk"

    @property
    def reshard_after_forward(self) -> bool:
        """The trained models' ``fsdp_config.reshard_after_forward`` unless set.

        Resharding re-gathers each layer's weights for the backward to save GPU memory. On CPU memory
        is not the limit and the copy is time (bench/README.md: 'A step').
        """
        return self.cuda

    def ray_resources(self, num_cpus: int | None = None) -> dict[str, Any]:
        """Arguments for a local ``ray.init``: logical GPUs on CPU so SkyRL's placement runs unchanged."""
        if self.cuda:
            return {}
        return {"num_gpus": CPU_LOGICAL_GPUS, "num_cpus": num_cpus or CPU_LOGICAL_GPUS}

    def ray_init_args(self, num_cpus: int | None = None) -> dict[str, Any]:
        """``ray.init`` arguments for a run's local Ray (the runtime env aside): public ones only; a
        CPU run's own head adds Ray's private settings (``compat.local_ray.SYSTEM_CONFIG``)."""
        return {"include_dashboard": False, **self.ray_resources(num_cpus)}

    def skyrl_overrides(self) -> dict[str, Any]:
        """SkyRL config values forced over the user's (they cannot work otherwise)."""
        overrides: dict[str, Any] = {}
        if not self.flash_attn:
            overrides.update(NO_FLASH_ATTN_CONFIG)
        if not self.cuda:
            overrides.update(CPU_CONFIG)
        return overrides
