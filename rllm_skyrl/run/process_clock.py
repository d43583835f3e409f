"""When this process started, to the clock tick: start-up is measured from there.

psutil's ``create_time`` adds the start (exact clock ticks since boot) to the boot time, which Linux
gives in whole seconds (``btime``): up to a second early. Against ``CLOCK_BOOTTIME``, the clock the
start is counted on, no boot time is needed.
"""

from __future__ import annotations

import os
import time

# /proc/<pid>/stat: after "pid (comm)", field 3 (state) comes first and field 22 is the start.
_STARTTIME_AFTER_COMM = 22 - 3


def process_started_at() -> float:
    """``time.time()`` when this process started: one clock tick (10 ms) on Linux, psutil's elsewhere."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            ticks = int(stat.read().rsplit(b")", 1)[1].split()[_STARTTIME_AFTER_COMM])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):  # no procfs (macOS)
        import psutil

        return psutil.Process().create_time()
