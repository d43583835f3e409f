"""What a run shows on the console: a progress bar with the live reward, and a summary at the end.

rLLM's trainer prints, whatever ``rllm.trainer.logger`` says, its config and every step a table of
about 90 metrics, two sample trajectories and a rollout bar. Unless ``console`` is among those
loggers, what the trainer prints goes to ``<run dir>/trainer_output.log`` (secrets masked, rLLM's
tables as plain lines), and the console keeps the bar, the log's warnings and errors, and the summary.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from rllm_skyrl.compat.rllm_metrics_table import plain_tables
from rllm_skyrl.run.metrics_file import read_metrics
from rllm_skyrl.secret_masking import MaskedStream

logger = logging.getLogger(__name__)

TRAINER_OUTPUT = "trainer_output.log"


@contextmanager
def trainer_output(run_dir: str | Path, masker: Any, on_console: bool) -> Iterator[None]:
    """Inside, unless ``on_console``, ``sys.stdout``/``sys.stderr`` go to ``<run_dir>/trainer_output.log``;
    log records keep going to their handlers (the console's among them)."""
    if on_console:
        yield
        return
    path = Path(run_dir) / TRAINER_OUTPUT
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as file:
        stream = MaskedStream(file, masker)
        with redirect_stdout(stream), redirect_stderr(stream), plain_tables():  # type: ignore[type-var]
            yield


class ProgressBar:
    """A trainer logger drawing a bar on ``stream`` from training records (not validation's); its
    length comes from the first record's ``progress/done_frac`` (tinker's step / total steps)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._bar: tqdm | None = None

    def log(self, data: Mapping[str, Any], step: int) -> None:
        reward = data.get("reward/mean")
        if reward is None:
            return
        if self._bar is None:
            done = data.get("progress/done_frac")
            total = round(step / done) if done else None
            self._bar = tqdm(
                total=total, initial=step, desc="training", unit="step", file=self._stream, dynamic_ncols=True
            )
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix(reward=f"{reward:.3f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def print_summary(run_dir: Path, records: list[dict]) -> None:
    """A few lines a user can act on: where the run is, and whether reward went up."""
    train = [r for r in records if "reward/mean" in r]
    lines = [f"run directory: {run_dir}", f"metrics: {run_dir / 'metrics.jsonl'}"]
    if train:
        window = max(1, min(10, len(train) // 4))
        first = sum(r["reward/mean"] for r in train[:window]) / window
        last = sum(r["reward/mean"] for r in train[-window:]) / window
        lines.append(
            f"steps: {train[-1]['step']}  reward/mean: {first:.3f} (first {window} steps) "
            f"-> {last:.3f} (last {window})"
        )
    validation = {k: v for k, v in records[-1].items() if k.startswith("val/") and "pass@" in k}
    lines += [f"{key}: {value:.3f}" for key, value in sorted(validation.items())]
    print("\n".join(lines), flush=True)


def finish_run(run_dir: str | Path) -> None:
    from rllm_skyrl.run.plot import plot_run  # matplotlib: only once there is something to draw

    run_dir = Path(run_dir)
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    if not records:
        return
    try:
        plot_run(run_dir)
    except ValueError as error:  # nothing plottable was logged
        logger.warning("no plot for %s: %s", run_dir, error)
    print_summary(run_dir, records)
