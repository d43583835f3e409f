"""The ``rllm_tracking`` set: the run's sinks (``metrics.jsonl``, the progress bar) in rLLM's ``Tracking``.

rLLM's trainer builds its ``Tracking`` from the names in ``rllm.trainer.logger`` and takes no
logger object, but ``Tracking.log`` hands every record to each entry of its ``logger`` table, so
the sinks are added to that table: no rLLM method is replaced. With the set off, rLLM's
``Tracking`` is left as rLLM built it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Sink(Protocol):
    def log(self, data: Any, step: int) -> None: ...


def apply(tracking: Any, sinks: Mapping[str, Sink]) -> None:
    """Add ``sinks`` after the trainer's own loggers; a trainer logger without the table (an rLLM
    version that logs differently) trains on without them, with a warning."""
    table = getattr(tracking, "logger", None)
    if not isinstance(table, dict):
        logger.warning(
            "rllm_skyrl: %s has no logger table (rLLM's Tracking.logger): training without %s",
            type(tracking).__name__,
            ", ".join(sinks),
        )
        return
    table.update(sinks)
