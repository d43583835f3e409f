"""Secrets masked in everything this process prints: its console streams, log records, tracebacks.

All fed by ``secret_masking.MASKER``. Entry points call ``mask_process_output`` first thing;
anything that learns a new secret (a server token) hands it to ``mask``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import Any

from rllm_skyrl import compat
from rllm_skyrl.secret_masking import MASKER, MaskedStream, SecretMasker, secret_values


def _cover_log_handlers() -> None:
    """The masker on every handler the root logger has now (handlers come and go with Hydra)."""
    handlers = list(logging.getLogger().handlers)
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for handler in handlers:
        if MASKER not in handler.filters:
            handler.addFilter(MASKER)


def apply() -> None:
    """Hook ``MASKER`` into the console streams, uncaught tracebacks, logging and loguru."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, MaskedStream):
            setattr(sys, name, MaskedStream(stream, MASKER))

    def excepthook(kind, value, traceback) -> None:
        import traceback as tb

        sys.stderr.write(MASKER.mask("".join(tb.format_exception(kind, value, traceback))))

    sys.excepthook = excepthook
    try:
        from loguru import logger as loguru_logger

        def patch(record: dict) -> None:
            record["message"] = MASKER.mask(record["message"])

        loguru_logger.configure(patcher=patch)
    except ImportError:
        pass
    _cover_log_handlers()


def mask(values: Iterable[str]) -> SecretMasker:
    MASKER.add(values)
    if compat.apply(["output_masking"]):
        _cover_log_handlers()
    return MASKER


def mask_process_output(config: Any = None) -> SecretMasker:
    """The environment's (and ``config``'s) secrets masked from now on: entry points call it first."""
    return mask(secret_values(config))
