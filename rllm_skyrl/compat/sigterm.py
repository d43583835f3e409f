"""The ``sigterm`` set: SIGTERM stops a run the way Ctrl-C does, whatever the run is doing then.

Inside ``asyncio.run`` (rLLM's trainers and ours) Ctrl-C does not raise where it lands: the runner's
SIGINT handler cancels the main task and the run unwinds through its ``finally`` blocks. An
exception raised by a signal handler lands in whatever the loop is running, often an HTTP client's
task half-way through a socket write, which dies of it ("Task exception was never retrieved" on top
of the one-line stop). Ray's driver handler (``sys.exit(15)``, installed by ``ray.init`` from the
main thread) does exactly that, so the run applies this set right after ``ray.init``: Ray's
handler is replaced by this module's. ``install`` alone, before ``ray.init``, takes only a SIGTERM
nobody handles (``run.exits.clean_stop``); with the set off, Ray's handler stays and its exit is
reported as a stop.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading

__all__ = ["Terminated", "apply", "install", "received", "uninstall"]


class Terminated(KeyboardInterrupt):
    """SIGTERM outside an event loop, raised where Ctrl-C raises KeyboardInterrupt."""


_installed = False
_received = False


def _on_sigterm(signum: int, frame: object) -> None:
    global _received
    _received = True
    on_sigint = signal.getsignal(signal.SIGINT)
    if isinstance(getattr(getattr(on_sigint, "func", None), "__self__", None), asyncio.Runner):
        # The runner cancels its main task now and raises KeyboardInterrupt once it has unwound;
        # a second signal raises at once, as a second Ctrl-C does.
        on_sigint(signal.SIGINT, frame)
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise Terminated() from None
    # asyncio.run installs no Ctrl-C handler when the run started with SIGINT ignored (``cmd &`` in a
    # script, nohup): the loop raises it between callbacks, not inside the task the signal
    # interrupted, and asyncio.run then cancels every task, so the run unwinds as above.
    loop.call_soon_threadsafe(_raise_terminated)


def _raise_terminated() -> None:
    raise Terminated()


def install() -> bool:
    """Handle SIGTERM here if this is the main thread and nothing else handles it; True if so."""
    global _installed, _received
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed, _received = True, False
    return True


def apply() -> None:
    """Once Ray is up (at every ``ray.init``): this module's handler if ``install`` took SIGTERM,
    else the exit Ray's driver handler makes (which ``ray.init`` installs only from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if _installed:
        signal.signal(signal.SIGTERM, _on_sigterm)
    elif signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit)


def _exit(signum: int, frame: object) -> None:
    sys.exit(signum)


def received() -> bool:
    """Whether SIGTERM arrived since ``install``: the runner reports it as KeyboardInterrupt."""
    return _received


def uninstall() -> None:
    global _installed
    if _installed:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _installed = False
