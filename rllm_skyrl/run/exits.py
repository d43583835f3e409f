"""How a run ends on the command line: a setting to fix is one line, a stop is a clean exit code."""

from __future__ import annotations

import atexit
import gc
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rllm_skyrl.compat import sigterm
from rllm_skyrl.errors import UserFacingError

__all__ = ["clean_stop", "one_line_errors"]


@contextmanager
def one_line_errors(always: bool = False) -> Iterator[None]:
    """On the command line (a Hydra app, or ``always``), a setting or file the user must fix is one
    line on stderr and exit code 2, not a traceback; library callers get the exception."""
    from hydra.core.hydra_config import HydraConfig

    try:
        yield
    except UserFacingError as error:
        if not (always or HydraConfig.initialized()):
            raise
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


@contextmanager
def clean_stop(always: bool = False) -> Iterator[None]:
    """A run stopped by Ctrl-C or SIGTERM shuts down what it started and exits within seconds.

    Python's default SIGTERM skips ``finally`` blocks: Ray's agents would outlive the run by half a
    minute. With this, SIGTERM unwinds like Ctrl-C (``compat.sigterm``). On the command line (a Hydra
    app, or ``always``) the stop is one line and exit code 130 (Ctrl-C) or 143 (SIGTERM), and live
    objects are frozen at exit: the interpreter's last garbage collection would otherwise walk
    everything torch, Ray and transformers loaded, seconds on two busy cores
    (bench/README.md: 'Start-up').
    """
    from hydra.core.hydra_config import HydraConfig

    handler_set = sigterm.install()
    command_line = always or HydraConfig.initialized()
    if command_line:
        atexit.register(gc.freeze)
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as stop:
        terminated = (handler_set and sigterm.received()) or (
            # Ray's own handler, where this one could not be installed (a worker thread's run)
            isinstance(stop, SystemExit) and stop.code == signal.SIGTERM
        )
        if not command_line or not (terminated or isinstance(stop, KeyboardInterrupt)):
            raise
        print(f"stopped by {'SIGTERM' if terminated else 'Ctrl-C'}", file=sys.stderr, flush=True)
        raise SystemExit(143 if terminated else 130) from None
    finally:
        if handler_set:
            sigterm.uninstall()
