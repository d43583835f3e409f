"""Tracking: metrics.jsonl, console line, redaction of secrets, offline wandb, and plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rllm_skyrl.run_log import read_metrics
from rllm_skyrl.secret_masking import REDACTED
from rllm_skyrl.standalone import Tracking, plot_run, redact
from rllm_skyrl.standalone.tracking import _wandb_mode, console_line

SECRET = "sk-live-0123456789abcdef"
CONFIG = {
    "model": {"name": "tiny", "hf_token": SECRET},
    "wandb": {"apiKey": SECRET, "project": "p"},
    "providers": [{"name": "a", "password": SECRET}, {"OPENAI_API_KEY": SECRET}],
    "rllm": {"rollout": {"train": {"max_tokens": 64}}, "tokenizer": "tiny", "secret_access_key": SECRET},
}


def test_redact_hides_secret_keys_but_keeps_lookalikes():
    safe = redact(CONFIG)
    assert SECRET not in json.dumps(safe)
    assert safe["model"] == {"name": "tiny", "hf_token": REDACTED}
    assert safe["wandb"]["apiKey"] == REDACTED and safe["providers"][0]["password"] == REDACTED
    assert safe["rllm"]["rollout"]["train"]["max_tokens"] == 64 and safe["rllm"]["tokenizer"] == "tiny"
    assert CONFIG["model"]["hf_token"] == SECRET  # the input is not modified


def test_metrics_jsonl_has_one_flat_record_per_step(tmp_path):
    tracking = Tracking(tmp_path, loggers=["console"], config=CONFIG)
    tracking.start(total_steps=3, resume_step=0)
    tracking.log(
        {"reward/mean": np.float32(0.5), "batch/n": np.int64(4), "train/kl": math.nan, "note": "x"}, 1
    )
    tracking.log({"reward/mean": 0.75, "time/step": 1.5}, 2)
    tracking.finish()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "reward/mean": 0.5, "batch/n": 4, "train/kl": None}
    assert json.loads(lines[1]) == {"step": 2, "reward/mean": 0.75, "time/step": 1.5}
    assert SECRET not in (tmp_path / "config.json").read_text()


def test_start_keeps_history_up_to_the_resumed_step_only(tmp_path):
    tracking = Tracking(tmp_path, loggers=[])
    tracking.start(total_steps=5, resume_step=0)
    for step in range(4):
        tracking.log({"reward/mean": float(step)}, step)
    Tracking(tmp_path, loggers=[]).start(total_steps=5, resume_step=2)  # died after step 3, resumed at 2
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    Tracking(tmp_path, loggers=[]).start(total_steps=5, resume_step=0)  # a fresh run in the same dir
    assert read_metrics(tmp_path) == []


def test_console_line_shows_the_key_metrics():
    metrics = {"reward/mean": 0.4123, "val/math/pass@1": 0.3, "train/kl": 0.00123, "time/step": 1.844}
    assert (
        console_line(3, 20, metrics)
        == "step 3/20 | reward 0.412 | val/math/pass@1 0.300 | kl 0.00123 | 1.84 s/step"
    )


def test_unknown_logger_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown logger"):
        Tracking(tmp_path, loggers=["tensorboard"])


def test_wandb_stays_offline_without_an_api_key(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert _wandb_mode(None) == "offline"
    assert _wandb_mode("online") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert _wandb_mode("online") == "online"
    assert _wandb_mode(None) == "offline"


def test_wandb_offline_run_never_sees_secrets(tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    tracking = Tracking(run_dir, project_name="p", experiment_name="e", loggers=["wandb"], config=CONFIG)
    tracking.start(total_steps=1, resume_step=0)
    tracking.log({"reward/mean": 1.0}, 1)
    tracking.finish()
    run_files = [p for p in (run_dir / "wandb").rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in run_files), "wandb wrote no offline run"
    assert all(SECRET.encode() not in p.read_bytes() for p in run_files)


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
    figures = drawn_panels(monkeypatch)
    tracking = Tracking(tmp_path, loggers=[])
    tracking.start(total_steps=4, resume_step=0)
    tracking.log({"val/math/pass@1": 0.1}, 0)
    for step in range(1, 5):
        metrics = {"reward/mean": step / 4, "time/step": 0.5 + step}
        if step % 2 == 0:
            metrics["val/math/pass@1"] = step / 8
        tracking.log(metrics, step)
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
