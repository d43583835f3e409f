"""The run's own sinks (``metrics.jsonl``, the progress bar) in rLLM's ``Tracking``.

rLLM's trainer builds its ``Tracking`` from the names in ``rllm.trainer.logger`` and takes no
logger object, but ``Tracking.log`` hands every record to each entry of its ``logger`` table, so
the sinks are added to that table: no rLLM method is replaced. The fallback trainer's logger has
the same table.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Sink(Protocol):
    def log(self, data: Any, step: int) -> None: ...


def add_sinks(tracking: Any, **sinks: Sink) -> bool:
    """Add ``sinks`` after the trainer's own loggers; returns whether they were added (a trainer
    logger without the table, an rLLM version that logs differently, trains on without them)."""
    table = getattr(tracking, "logger", None)
    if not isinstance(table, dict):
        logger.warning(
            "rllm_skyrl: %s has no logger table (rLLM's Tracking.logger): training without %s",
            type(tracking).__name__,
            ", ".join(sinks),
        )
        return False
    table.update(sinks)
    return True
