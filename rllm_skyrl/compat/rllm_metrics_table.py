"""rLLM's per-step metrics table as plain lines while the trainer's output goes to a file.

rLLM's ``UnifiedTrainer`` draws a rich table of every metric after each step whatever
``rllm.trainer.logger`` says. With the output moved to ``trainer_output.log`` nobody sees it drawn,
yet laying out its ~90 rows took about a tenth of a quickstart step on the driver.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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


@contextmanager
def plain_tables() -> Iterator[None]:
    """rLLM's trainer writes its metrics tables as text inside; rLLM's function again after."""
    from rllm_skyrl import compat

    module = sys.modules.get(TRAINER_MODULE)
    original = getattr(module, NAME, None)
    if original is None or not compat.usable(["rllm_metrics_table"]):  # not rLLM's trainer, or unverified
        yield
        return
    setattr(module, NAME, write_metrics)
    try:
        yield
    finally:
        setattr(module, NAME, original)
