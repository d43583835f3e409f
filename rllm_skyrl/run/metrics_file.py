"""A run's ``metrics.jsonl``: one JSON object per logged step, whichever trainer drives the run.

Appended as steps finish, so it is readable (and plottable) while the run goes on or after it died.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float | int | None]:
    """Numeric entries as JSON-safe Python numbers; non-finite floats become None (valid JSON)."""
    out: dict[str, float | int | None] = {}
    for key, value in metrics.items():
        if isinstance(value, int | np.integer | np.bool_):  # bool is an int
            out[key] = int(value)
        elif isinstance(value, float | np.floating):
            out[key] = float(value) if math.isfinite(value) else None
    return out


def _parse(path: Path) -> list[dict[str, Any]]:
    """Records of ``path``; a torn last line (a run killed mid-write) is dropped with a warning."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}:{number} is not a JSON object; the file is damaged") from None
            logger.warning("%s: dropping its torn last line %d (the run was stopped mid-write)", path, number)
    return records


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    return _parse(Path(run_dir) / METRICS_FILE)


class MetricsFile:
    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def keep_through(self, step: int) -> None:
        """Drop records after ``step`` (-1: all): a run that died after its last checkpoint, or an
        earlier run in this directory, wrote them, and the resumed run rewrites them (one history)."""
        if not self.path.exists():
            return
        kept = [record for record in _parse(self.path) if record["step"] <= step]
        self.path.write_text("".join(json.dumps(record) + "\n" for record in kept))

    def append(self, step: int, metrics: Mapping[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **scalar_metrics(metrics)}) + "\n")


class MetricsSink:
    """A trainer logger writing every record to ``<run_dir>/metrics.jsonl``; ``resumed_step()`` is
    asked at the first record, once the backend has restored a checkpoint."""

    def __init__(self, run_dir: str | Path, resumed_step: Callable[[], int | None]) -> None:
        self.file = MetricsFile(run_dir)
        self._resumed_step: Callable[[], int | None] | None = resumed_step

    def log(self, data: Mapping[str, Any], step: int) -> None:
        if self._resumed_step is not None:
            self.file.keep_through(self._resumed_step() or -1)
            self._resumed_step = None
        self.file.append(step, data)
