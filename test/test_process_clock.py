"""A process's start time, which start-up figures are measured from."""

from __future__ import annotations

import subprocess
import sys
import time

TICK_S = 0.01  # Linux counts a process's start in clock ticks of 10 ms


def test_a_process_knows_when_it_started_to_the_clock_tick():
    before = time.time()
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from rllm_skyrl.run.process_clock import process_started_at as s; print(s())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    after = time.time()
    started = float(child.stdout)
    # Between the spawn and its return, to a tick either side: psutil's create_time can be a
    # second early (the boot time it adds is rounded to whole seconds).
    assert before - TICK_S <= started <= after + TICK_S, (before, started, after)
