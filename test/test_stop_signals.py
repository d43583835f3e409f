"""SIGTERM unwinds a run as Ctrl-C does, also when it lands inside one of the event loop's tasks."""

from __future__ import annotations

import asyncio
import os
import signal as _signal
import subprocess
import sys
import textwrap

import pytest
import ray.exceptions
import torch

from rllm_skyrl.checkpoint.manager import failure_report

# The signal is raised from inside a task other than the main one: Python runs the handler in that
# task's frame, as it does when SIGTERM lands while an HTTP client's task writes to a socket.
_RUN = """
import asyncio, os, signal, sys, time
from rllm_skyrl import compat
from rllm_skyrl.run.exits import clean_stop

async def request():
    try:
        os.kill(os.getpid(), signal.{signal})
        for _ in range(3000):
            await asyncio.sleep(0.001)
    except BaseException as stop:
        print("request ended by", type(stop).__name__, flush=True)
        raise

async def main():
    task = asyncio.create_task(request())
    try:
        await asyncio.sleep(30)
    finally:
        print("unwound", flush=True)

with clean_stop(always=True):
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init installs
    if {reclaim}:
        compat.apply(["sigterm"])  # what ray_cluster.start_ray does after ray.init
    {body}
"""


def _run(
    signal: str = "SIGTERM",
    reclaim: bool = True,
    body: str = "asyncio.run(main())",
    env=None,
    sigint=_signal.SIG_DFL,
):
    """The script in a child whose Ctrl-C is ``sigint``: its default, as a terminal starts a program,
    or ignored, as a script's ``cmd &`` or nohup starts it (whatever the suite itself was started with)."""
    script = textwrap.dedent(_RUN).format(signal=signal, reclaim=reclaim, body=body)
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        preexec_fn=lambda: _signal.signal(_signal.SIGINT, sigint),
    )


def test_sigterm_inside_a_task_cancels_the_run_instead_of_killing_the_task():
    done = _run()
    assert done.returncode == 143, done.stderr
    assert "request ended by CancelledError" in done.stdout and "unwound" in done.stdout, done.stdout
    assert "stopped by SIGTERM" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_sigterm_in_a_run_started_in_the_background_also_cancels_the_run():
    """Started with SIGINT ignored, asyncio.run installs no Ctrl-C handler to forward SIGTERM to."""
    done = _run(sigint=_signal.SIG_IGN)
    assert done.returncode == 143, done.stderr
    assert "request ended by CancelledError" in done.stdout and "unwound" in done.stdout, done.stdout
    assert "stopped by SIGTERM" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_without_the_handler_taken_back_the_task_dies_of_the_signal():
    """What the handler prevents: Ray's ``sys.exit`` raised in the task's frame kills that task, and
    asyncio logs its traceback when the task is collected."""
    done = _run(reclaim=False)
    assert "request ended by SystemExit" in done.stdout, done.stdout


def test_with_the_sigterm_set_turned_off_rays_handler_stays():
    """``RLLM_SKYRL_COMPAT_DISABLE=sigterm``: the table leaves Ray's handler in place, which exits
    from inside the task (the stop is still reported as SIGTERM, from Ray's exit code)."""
    done = _run(env={"RLLM_SKYRL_COMPAT_DISABLE": "sigterm"})
    assert "request ended by SystemExit" in done.stdout, done.stdout
    assert done.returncode == 143 and "stopped by SIGTERM" in done.stderr, done.stderr


def test_sigterm_outside_an_event_loop_raises_where_the_run_is():
    done = _run(body="os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)")
    assert done.returncode == 143, done.stderr
    assert "stopped by SIGTERM" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_ctrl_c_inside_a_task_is_still_ctrl_c():
    done = _run(signal="SIGINT")
    assert done.returncode == 130, done.stderr
    assert "request ended by CancelledError" in done.stdout and "unwound" in done.stdout, done.stdout
    assert "stopped by Ctrl-C" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("stop", [asyncio.CancelledError(), KeyboardInterrupt()])
def test_a_stopped_run_is_reported_as_stopped_not_as_an_exception_name(stop):
    report = failure_report(stop, 2, None)
    assert report.startswith("training stopped at step 2: stopped by Ctrl-C or SIGTERM;"), report


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
        ray.exceptions.ActorDiedError(),  # its text is set below: Ray's memory monitor's kill
    ],
    ids=["cuda", "python", "ray_memory_monitor"],
)
def test_running_out_of_memory_is_reported_with_the_settings_that_lower_it(error):
    if isinstance(error, ray.exceptions.ActorDiedError):
        error.error_msg = "The actor died. Memory on the node was 95% full: out of memory (raylet)"
    report = failure_report(error, 3, None)
    assert report.startswith("training stopped at step 3: out of memory ("), report
    assert "skyrl.trainer.micro_train_batch_size_per_gpu" in report and "\n" not in report, report
