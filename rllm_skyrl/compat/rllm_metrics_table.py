"""The ``rllm_metrics_table`` set: rLLM's per-step metrics table as plain lines while the trainer's
output goes to a file (on CPU; on CUDA rLLM's own table).

rLLM's ``UnifiedTrainer`` draws a rich table of every metric after each step whatever
``rllm.trainer.logger`` says. With the output moved to ``trainer_output.log`` nobody sees it drawn,
yet laying out its ~90 rows took a noticeable share of a quickstart step on the driver
(bench/README.md: 'A step').
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

TRAINER_MODULE = "rllm.trainer.unified_trainer"
NAME = "print_metrics_table"


def write_metrics(metrics: Mapping[str, Any], step: int, title: str | None = None) -> None:
    width = max((len(key) for key in metrics), default=0)
    lines = [title or f"Step {step}"]
    lines += [
        f"{key:<{width}}  {value:.6g}" if isinstance(value, float) else f"{key:<{width}}  {value}"
        for key, value in sorted(metrics.items())
    ]
    print("\n".join(lines))


def apply(module: ModuleType) -> None:
    setattr(module, NAME, write_metrics)


@contextmanager
def plain_tables() -> Iterator[None]:
    """rLLM's trainer writes its metrics tables as text inside; rLLM's function again after."""
    from rllm_skyrl import compat

    module = sys.modules.get(TRAINER_MODULE)
    original = getattr(module, NAME, None)
    # not rLLM's trainer, or the set does not apply (CUDA, unverified, turned off)
    if original is None or not compat.apply(["rllm_metrics_table"], module, platform=compat.this_machine()):
        yield
        return
    try:
        yield
    finally:
        setattr(module, NAME, original)
