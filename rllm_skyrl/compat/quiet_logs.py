"""Log levels of SkyRL, Ray and httpx for a run's console."""

from __future__ import annotations

import logging
import os
import sys


def quiet_libraries(level: str | None = None) -> None:
    """Keep the console for the run: SkyRL's start-up notes and per-request HTTP lines go
    (``RLLM_SKYRL_LOG_LEVEL=INFO`` brings them back; the run's ``logs/`` has them too)."""
    import skyrl.utils.log  # noqa: F401  (sets SkyRL's logger to DEBUG on import: import it first)

    level = (level or os.environ.get("RLLM_SKYRL_LOG_LEVEL") or "WARNING").upper()
    for name in ("httpx", "skyrl", "ray"):
        logging.getLogger(name).setLevel(level)
    from loguru import logger as loguru_logger

    loguru_logger.remove()
    loguru_logger.add(sys.stderr, level=level)
