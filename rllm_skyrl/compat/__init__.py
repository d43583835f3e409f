"""The only place that changes SkyRL at run time: named patch sets, applied where ``Platform`` says.

| set | when (``Platform.compat_patches``) | module |
|---|---|---|
| ``package_index`` | always | ``package_index`` |
| ``lazy_imports`` | always | ``lazy_imports`` |
| ``registries_in_gcs`` | always | ``registries`` |
| ``flash_attn_stub`` | flash-attn not installed (always on CPU; on CUDA unless added) | ``flash_attn`` |
| ``cpu`` | no CUDA | ``cpu`` |
| ``tied_embeddings`` | always | ``tied_embeddings`` |
| ``response_logits`` | always | ``response_logits`` |
| ``memory_snapshots`` | always, in the driver only | ``memory_snapshots`` |
| ``single_rank_reductions`` | always | ``single_rank_reductions`` |

The driver calls ``apply(names)``; Ray workers run ``apply_from_env`` as their
``worker_process_setup_hook`` and read the same names from ``RLLM_SKYRL_COMPAT``, which the
driver puts into the runtime env: the decision is made once, by the driver, and no worker asks
CUDA anything before Ray has assigned it its devices. A patch set's module (which imports torch
and SkyRL's worker modules) is imported only when that set is applied.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable

# Application order: transformers' package map and the lazy imports before anything imports
# transformers or what they defer; SkyRL's registries before anything imports them; the stub
# before the sets that import SkyRL's worker modules.
PATCH_SETS = {
    "package_index": "rllm_skyrl.compat.package_index",
    "lazy_imports": "rllm_skyrl.compat.lazy_imports",
    "registries_in_gcs": "rllm_skyrl.compat.registries",
    "flash_attn_stub": "rllm_skyrl.compat.flash_attn",
    "cpu": "rllm_skyrl.compat.cpu",
    "tied_embeddings": "rllm_skyrl.compat.tied_embeddings",
    "response_logits": "rllm_skyrl.compat.response_logits",
    "memory_snapshots": "rllm_skyrl.compat.memory_snapshots",
    "single_rank_reductions": "rllm_skyrl.compat.single_rank_reductions",
}
# Sets that change what only the driver runs (SkyRL's dispatch), kept out of the workers' hook.
DRIVER_ONLY = frozenset({"memory_snapshots"})
SETUP_HOOK = "rllm_skyrl.compat.apply_from_env"
ENV_VAR = "RLLM_SKYRL_COMPAT"


def apply(names: Iterable[str]) -> None:
    """Install the named patch sets in this process (each once), in ``PATCH_SETS`` order."""
    wanted = set(names)
    unknown = sorted(wanted - set(PATCH_SETS))
    if unknown:
        raise ValueError(f"unknown SkyRL patch set(s) {unknown}; known: {list(PATCH_SETS)}")
    for name, module in PATCH_SETS.items():
        if name in wanted:
            importlib.import_module(module).apply()


def apply_from_env() -> None:
    """Ray's worker set-up hook: the patch sets the driver listed in ``RLLM_SKYRL_COMPAT``."""
    apply(name for name in os.environ.get(ENV_VAR, "").split(",") if name)
