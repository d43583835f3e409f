"""An all-reduce over a data-parallel group of one rank returns its input, without the collective.

SkyRL's workers all-reduce every scalar metric of every update across their DP group
(``worker_utils.all_reduce_metrics``): ``DistributedStrategy.all_reduce`` makes each value a tensor
and runs one collective per metric and per reduction. Over a group of one rank the result is the
value itself, but each collective still goes through the process group (gloo on CPU: about 150 us
each, some 5 ms of a quickstart step). With one rank the patched method returns what the
collective would have: a tensor unchanged, a number as the float32 SkyRL's own path rounds it to.
Groups of several ranks take SkyRL's path unchanged. Applied on every platform and in every worker.
"""

from __future__ import annotations

import functools

from rllm_skyrl.compat.patch import Patch

_STRATEGY = "skyrl.backends.skyrl_train.distributed.strategy"


def _local_when_alone() -> None:
    import torch
    import torch.distributed as dist
    from skyrl.backends.skyrl_train.distributed.strategy import DistributedStrategy

    original = DistributedStrategy.all_reduce
    if getattr(original, "_rllm_skyrl_patched", False):
        return

    @functools.wraps(original)
    def all_reduce(self, data, op="mean", group=None):
        size = dist.get_world_size(group) if group is not None else self.world_size
        if size != 1 or op not in ("mean", "max", "sum", "min"):
            return original(self, data, op, group=group)  # which refuses an unknown op itself
        if isinstance(data, dict):
            return {key: all_reduce(self, value, op, group=group) for key, value in data.items()}
        if isinstance(data, torch.Tensor):
            return data
        return torch.Tensor([data]).item()  # SkyRL's path reduces a float32 copy of the number

    all_reduce._rllm_skyrl_patched = True
    DistributedStrategy.all_reduce = all_reduce


PATCHES: tuple[Patch, ...] = (
    Patch(
        "single_rank_reductions",
        (
            _STRATEGY,
            "DistributedStrategy.all_reduce",
            "dist.all_reduce(data, op=dist.ReduceOp.SUM, group=group)",
        ),
        _local_when_alone,
    ),
)


def apply() -> None:
    """Install the patch (idempotent)."""
    for patch in PATCHES:
        patch.install()
