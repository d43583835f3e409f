"""Skip the memory-snapshot call SkyRL's dispatch makes after every update when no worker records.

``WorkerDispatch.forward_backward`` and ``optim_step`` each end with ``_save_memory_snapshot``: a
second round trip to every worker of the role, whose ``save_memory_snapshot`` returns at once
unless the worker was built with ``record_memory``. The actor group knows whether it was, so the
dispatch can skip a call whose answer it already knows: two of the four Ray round trips of a
quickstart step (about 1.5 ms each on two CPU cores). A group built with ``record_memory`` still
gets every snapshot. Applied on every platform: the call is the same on GPU.
"""

from __future__ import annotations

import functools

from rllm_skyrl.compat.patch import Patch

_DISPATCH = "skyrl.backends.skyrl_train.workers.worker_dispatch"


def _skip_snapshots_nobody_records() -> None:
    from skyrl.backends.skyrl_train.workers import worker_dispatch

    dispatch_class = worker_dispatch.WorkerDispatch
    original = vars(dispatch_class).get("_save_memory_snapshot")
    if original is None or getattr(original, "_rllm_skyrl_patched", False):
        return  # installed already (or WorkerDispatch is a stand-in: nothing of SkyRL's to patch)

    @functools.wraps(original)
    def _save_memory_snapshot(self, model: str, tag: str) -> None:
        if not getattr(self._actor_groups[model], "record_memory", True):
            return  # each worker's save_memory_snapshot would return without doing anything
        original(self, model, tag)

    _save_memory_snapshot._rllm_skyrl_patched = True
    dispatch_class._save_memory_snapshot = _save_memory_snapshot


PATCHES: tuple[Patch, ...] = (
    Patch(
        "skip_unrecorded_memory_snapshots",
        (
            _DISPATCH,
            "WorkerDispatch.forward_backward",
            'self._save_memory_snapshot(model, "forward_backward")',
        ),
        _skip_snapshots_nobody_records,
    ),
)


def apply() -> None:
    """Install the patch (idempotent). SkyRL's worker modules import flash-attn: stub it first."""
    for patch in PATCHES:
        patch.install()
