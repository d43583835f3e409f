"""Follow a training process's per-step records from outside, as they are appended.

A run writes one JSON object per step (this package's ``metrics.jsonl``; TRL's records from
``bench/trl_grpo.py``). ``follow`` starts the process and stamps every record on arrival with the
seconds since the process was started, the CPU time its whole process tree has used so far (Ray
workers and inference servers are descendants of the driver) and the load average, so the
benchmarks can measure what a user waits for, steps' wall times between records included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

POLL_SECONDS = 0.05  # the arrival stamps are late by at most this


@dataclass
class Side:
    """One run as followed from outside: its step records, each with arrival time, CPU and load."""

    name: str
    records: list[dict] = field(default_factory=list)
    arrival: list[float] = field(default_factory=list)  # seconds from process start to the record
    cpu: list[float] = field(default_factory=list)  # CPU seconds of the process tree so far
    load: list[float] = field(default_factory=list)  # 1-minute load average at each record
    exit_code: int | None = None
    log: Path | None = None

    def rewards(self) -> list[float]:
        return [r["reward/mean"] for r in self.records]

    def step_walls(self) -> list[float]:
        """Wall time of every step after the first: the time between consecutive records."""
        return [b - a for a, b in zip(self.arrival, self.arrival[1:], strict=False)]


def tree_cpu_seconds(root: psutil.Process) -> float:
    """User + system CPU of a process and every live descendant, reaped children included."""
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def _interruptible() -> None:
    """SIGINT as Python expects it: a shell starts background jobs (``nohup ... &``) with it
    ignored, their children inherit that, and ``stop_when``'s SIGINT would then go unheard."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def follow(
    side: Side,
    argv: list[str],
    records_path: Path,
    *,
    cwd: Path,
    env: dict[str, str],
    timeout: float,
    stop_when: Callable[[Side], bool] | None = None,
) -> Side:
    """Run ``argv`` and collect its step records (those with ``reward/mean``) until it exits.

    With ``stop_when``, the process gets SIGINT once ``stop_when(side)`` holds (this package's
    launcher then shuts Ray, workers and servers down) and up to two minutes to exit. After
    ``timeout`` seconds its process group is killed. Output goes to ``<records dir>/<name>.log``.
    """
    side.log = records_path.parent / f"{side.name}.log"
    side.log.parent.mkdir(parents=True, exist_ok=True)
    spawned = time.time()
    with side.log.open("w") as log:
        child = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_interruptible,
        )
    root = psutil.Process(child.pid)
    offset, stopping, deadline = 0, False, spawned + timeout
    while True:
        exited = child.poll() is not None
        for record in _new_records(records_path, offset):
            offset = record.pop("_offset")
            if "reward/mean" not in record:
                continue  # validation records
            side.records.append(record)
            side.arrival.append(record.get("wall", time.time()) - spawned)
            side.cpu.append(tree_cpu_seconds(root))
            side.load.append(os.getloadavg()[0])
        if exited:
            break
        if stop_when is not None and not stopping and stop_when(side):
            child.send_signal(signal.SIGINT)
            stopping, deadline = True, time.time() + 120
        if time.time() > deadline:
            print(f"{side.name}: still running at its time limit; killing its process group", file=sys.stderr)
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            break
        time.sleep(POLL_SECONDS)
    side.exit_code = child.returncode
    return side


def _new_records(path: Path, offset: int) -> list[dict]:
    """Complete lines after byte ``offset``; each record carries the offset after it as ``_offset``.

    A line still being written (no newline yet) is left for the next call.
    """
    if not path.exists():
        return []
    with path.open("rb") as f:
        f.seek(offset)
        chunk = f.read()
    records = []
    for line in chunk.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        offset += len(line)
        if line.strip():
            records.append(json.loads(line) | {"_offset": offset})
    return records
