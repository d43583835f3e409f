"""What a run writes and shows, whichever trainer drives it: metrics.jsonl, the progress bar, the
trainer's own output moved off the console, plots."""

from __future__ import annotations

import io
import json
import logging
import math
import sys

import numpy as np
import pytest

from rllm_skyrl.compat import rllm_tracking
from rllm_skyrl.run.console import TRAINER_OUTPUT, ProgressBar, trainer_output
from rllm_skyrl.run.metrics_file import MetricsSink, read_metrics
from rllm_skyrl.secret_masking import REDACTED, SecretMasker, redact

SECRET = "sk-live-0123456789abcdef"
CONFIG = {
    "model": {"name": "tiny", "hf_token": SECRET},
    "wandb": {"apiKey": SECRET, "project": "p"},
    "providers": [{"name": "a", "password": SECRET}, {"OPENAI_API_KEY": SECRET}],
    "rllm": {"rollout": {"train": {"max_tokens": 64}}, "tokenizer": "tiny", "secret_access_key": SECRET},
}


class Recorder:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, data, step):
        self.logged.append((step, dict(data)))


class TrainerLogger:
    """What the one run function finds on either trainer: rLLM's ``Tracking`` shape, a ``logger``
    table whose every entry gets each record."""

    def __init__(self) -> None:
        self.trainers_own = Recorder()
        self.logger = {"console": self.trainers_own}
        self.logged = self.trainers_own.logged

    def log(self, data, step, **kwargs):
        for sink in self.logger.values():
            sink.log(data=data, step=step)


def mirror_logger(tracking, run_dir, resumed_step):
    rllm_tracking.apply(tracking, {"metrics_jsonl": MetricsSink(run_dir, resumed_step)})


def test_redact_hides_secret_keys_but_keeps_lookalikes():
    safe = redact(CONFIG)
    assert SECRET not in json.dumps(safe)
    assert safe["model"] == {"name": "tiny", "hf_token": REDACTED}
    assert safe["wandb"]["apiKey"] == REDACTED and safe["providers"][0]["password"] == REDACTED
    assert safe["rllm"]["rollout"]["train"]["max_tokens"] == 64 and safe["rllm"]["tokenizer"] == "tiny"
    assert CONFIG["model"]["hf_token"] == SECRET  # the input is not modified


def test_metrics_jsonl_has_one_flat_record_per_step_and_the_trainer_still_gets_it(tmp_path):
    trainer_logger = TrainerLogger()
    mirror_logger(trainer_logger, tmp_path, lambda: None)
    trainer_logger.log(
        {"reward/mean": np.float32(0.5), "batch/n": np.int64(4), "train/kl": math.nan, "note": "x"}, 1
    )
    trainer_logger.log({"reward/mean": 0.75, "time/step": 1.5}, 2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "reward/mean": 0.5, "batch/n": 4, "train/kl": None}
    assert json.loads(lines[1]) == {"step": 2, "reward/mean": 0.75, "time/step": 1.5}
    assert [step for step, _ in trainer_logger.logged] == [1, 2]


def test_a_resumed_run_keeps_the_history_up_to_its_checkpoint_only(tmp_path):
    first = TrainerLogger()
    mirror_logger(first, tmp_path, lambda: None)
    for step in range(4):
        first.log({"reward/mean": float(step)}, step)
    resumed = TrainerLogger()
    mirror_logger(resumed, tmp_path, lambda: 2)  # died after step 3, resumed from the step-2 checkpoint
    resumed.log({"reward/mean": 3.0}, 3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]
    fresh = TrainerLogger()
    mirror_logger(fresh, tmp_path, lambda: None)  # a fresh run in the same directory
    fresh.log({"reward/mean": 0.0}, 1)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_the_progress_bar_follows_training_records_with_the_live_reward():
    console = io.StringIO()
    trainer_logger = TrainerLogger()
    bar = ProgressBar(console)
    rllm_tracking.apply(trainer_logger, {"progress_bar": bar})
    trainer_logger.log({"val/a/pass@1": 0.0}, 0)  # validation: not a step
    for step in (3, 4, 5):  # a run resumed after step 2 of 5
        trainer_logger.log(
            {"reward/mean": step / 10, "progress/batch": step, "progress/done_frac": step / 5}, step
        )
    bar.close()
    text = console.getvalue()
    assert "training: 100%" in text and "5/5" in text and "reward=0.500" in text
    assert "0/5" not in text and "2/5" not in text  # the bar starts at the resumed step
    assert len(trainer_logger.logged) == 4


def test_a_logger_without_rllms_table_trains_on_without_the_sinks_and_says_so(caplog):
    trainer_logger = Recorder()
    with caplog.at_level(logging.WARNING):
        rllm_tracking.apply(trainer_logger, {"metrics_jsonl": Recorder(), "progress_bar": Recorder()})
    assert "Recorder has no logger table" in caplog.text and "metrics_jsonl, progress_bar" in caplog.text
    trainer_logger.log({"reward/mean": 1.0}, 1)
    assert trainer_logger.logged == [(1, {"reward/mean": 1.0})]


def test_the_trainers_output_goes_to_the_run_directory_masked_and_logs_stay(tmp_path, capsys, caplog):
    masker = SecretMasker([SECRET])
    with trainer_output(tmp_path, masker, on_console=False):
        print(f"a table with {SECRET}")
        print("a progress bar", file=sys.stderr)
        logging.getLogger("rllm_skyrl.test").warning("a warning")
    print("after")
    assert (tmp_path / TRAINER_OUTPUT).read_text() == f"a table with {REDACTED}\na progress bar\n"
    assert capsys.readouterr().out == "after\n"
    assert "a warning" in caplog.text  # log records keep their handlers
    with trainer_output(tmp_path / "console", masker, on_console=True):
        print("shown")
    assert capsys.readouterr().out == "shown\n" and not (tmp_path / "console").exists()


def test_rllms_metrics_tables_go_to_the_file_as_plain_lines(tmp_path, capsys):
    """rLLM's trainer draws a rich table of every metric each step; with its output in the run
    directory the same rows are written as text, and rLLM's own function is back afterwards."""
    trainer_module = pytest.importorskip("rllm.trainer.unified_trainer")
    rllms = trainer_module.print_metrics_table
    metrics = {"reward/mean": 0.25, "time/step": 0.5, "batch/size": 512, f"x/{SECRET}": 1.0}
    with trainer_output(tmp_path, SecretMasker([SECRET]), on_console=False):
        assert trainer_module.print_metrics_table is not rllms
        trainer_module.print_metrics_table(metrics, 7)
    assert trainer_module.print_metrics_table is rllms
    lines = (tmp_path / TRAINER_OUTPUT).read_text().splitlines()
    assert lines[0] == "Step 7" and len(lines) == 1 + len(metrics)
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["batch/size", "reward/mean", "time/step", f"x/{REDACTED}"]
    assert lines[2].split()[1] == "0.25" and lines[1].split()[1] == "512"
    assert "┃" not in "".join(lines) and capsys.readouterr().out == ""
    with trainer_output(tmp_path / "console", SecretMasker([]), on_console=True):
        assert trainer_module.print_metrics_table is rllms  # on the console rLLM draws its table


def drawn_panels(monkeypatch) -> list[dict[str, dict[str, tuple[list, list]]]]:
    """Every figure ``plot_run`` saves, as {panel title: {line label: (steps, values)}}."""
    from matplotlib.figure import Figure

    figures: list[dict] = []
    original = Figure.savefig

    def recording(fig, *args, **kwargs):
        figures.append(
            {
                ax.get_title(): {
                    line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                    for line in ax.get_lines()
                }
                for ax in fig.axes
                if ax.get_visible()
            }
        )
        return original(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording)
    return figures


def test_plot_run_draws_the_series_that_exist(tmp_path, monkeypatch):
    from rllm_skyrl.run.plot import plot_run

    figures = drawn_panels(monkeypatch)
    trainer_logger = TrainerLogger()
    mirror_logger(trainer_logger, tmp_path, lambda: None)
    trainer_logger.log({"val/math/pass@1": 0.1}, 0)
    for step in range(1, 5):
        metrics = {"reward/mean": step / 4, "time/step": 0.5 + step}
        if step % 2 == 0:
            metrics["val/math/pass@1"] = step / 8
        trainer_logger.log(metrics, step)
    png = plot_run(tmp_path)
    assert png == tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (panels,) = figures
    assert panels == {  # no KL was logged: no KL panel
        "training reward": {"reward/mean": ([1, 2, 3, 4], [0.25, 0.5, 0.75, 1.0])},
        "validation pass@1": {"val/math/pass@1": ([0, 2, 4], [0.1, 0.25, 0.5])},
        "seconds per step": {"time/step": ([1, 2, 3, 4], [1.5, 2.5, 3.5, 4.5])},
    }

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "other": 1.0}) + "\n")
    with pytest.raises(ValueError, match="has none of"):
        plot_run(tmp_path)
