"""The ``quiet_logs`` set: SkyRL's, Ray's and httpx's log levels for a run's console.

SkyRL sets its logger to DEBUG when imported and logs start-up notes and HTTP requests at INFO; the
console is kept for the run (``RLLM_SKYRL_LOG_LEVEL=INFO`` brings them back; the run's ``logs/``
has them too). loguru's own default sink (id 0, stderr as it was when loguru was imported) is
replaced by one on the current stderr at that level; every other loguru sink, the user's or
SkyRL's, is left as it is and keeps receiving what it asked for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

LEVEL_VAR = "RLLM_SKYRL_LOG_LEVEL"
LOGURU_DEFAULT_SINK = 0


def apply() -> None:
    import skyrl.utils.log  # noqa: F401  (sets SkyRL's logger to DEBUG on import: import it first)
    from loguru import logger as loguru_logger

    level = (os.environ.get(LEVEL_VAR) or "WARNING").upper()
    for name in ("httpx", "skyrl", "ray"):
        logging.getLogger(name).setLevel(level)
    with contextlib.suppress(ValueError):  # gone already: whoever removed it configured loguru
        loguru_logger.remove(LOGURU_DEFAULT_SINK)
        loguru_logger.add(sys.stderr, level=level)
