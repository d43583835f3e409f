"""Secrets masked in everything this process prints: its console streams, log records, tracebacks.

A patch set (``compat``'s ``output_masking``): it wraps ``sys.stdout`` and ``sys.stderr``, chains
``sys.excepthook``, adds a filter to the logging handlers and a patcher to loguru, all fed by
``secret_masking.MASKER``. Entry points call ``mask_process_output`` first thing; anything that
learns a new secret (a server token) hands it to ``mask``.
"""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from rllm_skyrl import compat
from rllm_skyrl.secret_masking import MASKER, SecretMasker, secret_values


class _MaskedStream(io.TextIOBase):
    """A console stream that masks secrets in whatever passes through it (tqdm's bar included)."""

    def __init__(self, stream: TextIO, masker: SecretMasker) -> None:
        self._stream = stream
        self._masker = masker

    def write(self, text: str) -> int:
        self._stream.write(self._masker.mask(text))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", "utf-8")

    def __getattr__(self, name: str) -> Any:  # anything else (``buffer``, ``errors``...) is the stream's
        return getattr(self._stream, name)


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
        if not isinstance(stream, _MaskedStream):
            setattr(sys, name, _MaskedStream(stream, MASKER))
    original = sys.excepthook

    def excepthook(kind, value, traceback) -> None:
        import traceback as tb

        sys.stderr.write(MASKER.mask("".join(tb.format_exception(kind, value, traceback))))

    excepthook.original = original
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
    """Mask ``values`` in everything this process prints from now on."""
    MASKER.add(values)
    if compat.apply(["output_masking"]):
        _cover_log_handlers()
    return MASKER


def mask_process_output(config: Any = None) -> SecretMasker:
    """The environment's (and ``config``'s) secrets masked from now on: entry points call it first."""
    return mask(secret_values(config))
