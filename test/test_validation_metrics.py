"""Validation, metric names, console output, secrets and plots, checked on real runs.

The runs are shared with ``test_checkpoint_resume.py`` (see ``training_runs.py``). The workflow
logs every rollout, so validation metrics are recomputed here from what was actually sampled.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from training_runs import CONFIG_SECRET, SECRETS, assert_ok

from rllm_skyrl import rllm_api
from rllm_skyrl.records import Episode
from rllm_skyrl.standalone.episodes import validation_metrics

N_VAL = 3  # validation.group_size in apps/train_digits.yaml
VAL_SOURCES = ("digits_a", "digits_b")


def test_validation_metrics_by_hand():
    correct = {"a-0": [1, 0, 0], "a-1": [0, 0, 0], "b-0": [1, 1, 1]}
    episodes = [
        Episode(id=f"{task}:{i}", metadata={"data_source": task[0]}, is_correct=bool(c), metrics={"acc": c})
        for task, outcomes in correct.items()
        for i, c in enumerate(outcomes)
    ]
    metrics = validation_metrics(episodes, n_val=3)
    assert metrics["val/a/pass@1"] == pytest.approx(1 / 6) and metrics["val/a/pass@3"] == 0.5
    assert metrics["val/b/pass@1"] == 1.0 and metrics["val/b/pass@3"] == 1.0
    assert metrics["val/a/acc"] == pytest.approx(1 / 6)


@pytest.fixture(scope="module")
def straight(digits_runs):
    assert_ok(digits_runs.straight)
    return digits_runs.straight


def _by_step(records: list[dict]) -> dict[int, dict]:
    merged: dict[int, dict] = defaultdict(dict)
    for record in records:
        merged[record["step"]].update(record)
    return merged


@pytest.mark.slow
def test_validation_runs_before_training_every_test_freq_steps_and_at_the_end(straight):
    val_steps = sorted({r["step"] for r in straight.metrics() if "val/digits_a/pass@1" in r})
    assert val_steps == [0, 2, 4]  # val_before_train, test_freq=2, last step
    sampled = sorted({r["version"] for r in straight.rollouts() if r["val"]})
    assert sampled == [0, 2, 4]  # each validation sampled the policy of its step


@pytest.mark.slow
def test_pass_at_k_matches_the_sampled_rollouts(straight):
    metrics = _by_step(straight.metrics())
    outcomes: dict[tuple[int, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in straight.rollouts():
        if record["val"]:
            outcomes[(record["version"], record["source"])][record["task_id"]].append(record["reward"])
    for (step, source), tasks in outcomes.items():
        assert all(len(rewards) == N_VAL for rewards in tasks.values())  # n_val rollouts per task
        pass1 = sum(r > 0 for rewards in tasks.values() for r in rewards) / (N_VAL * len(tasks))
        pass_n = sum(any(r > 0 for r in rewards) for rewards in tasks.values()) / len(tasks)
        assert metrics[step][f"val/{source}/pass@1"] == pytest.approx(pass1)
        assert metrics[step][f"val/{source}/pass@{N_VAL}"] == pytest.approx(pass_n)
    assert {source for _, source in outcomes} == set(VAL_SOURCES)
    assert any(0 < metrics[s][f"val/{src}/pass@1"] < 1 for s in (0, 2, 4) for src in VAL_SOURCES)


@pytest.mark.slow
def test_validation_uses_the_validation_sampling_params(straight):
    rollouts = straight.rollouts()
    assert {r["tokens"] for r in rollouts if r["val"]} == {1}  # rllm.rollout.val.max_tokens=1
    assert max(r["tokens"] for r in rollouts if not r["val"]) == 2  # training: max_response_length


RLLM_NAMES = [
    "progress/batch",
    "progress/epoch",
    "progress/lr",
    "progress/done_frac",
    "time/step",
    "time/generate",
    "time/forward_backward",
    "time/optim_step",
    "time/weight_sync",
    "train/loss",
    "train/grad_norm",
    "train/entropy",
    "train/kl_sample_train_v1",
    "train/kl_sample_train_v2",
    "train/perplexity",
    "train/logprob_abs_diff/mean",
    "train/logprob_abs_diff/max",
    "perf/rollout_tokens_per_s",
    "batch/dropped_malformed_sequences",
    "batch/steps_per_traj/mean",
    "batch/step_response_length/mean",
    "batch/termination_reason/env_done",
    "reward/mean",
    "reward/std",
    "reward/agent/mean",
]


@pytest.mark.slow
def test_metric_names_and_values(straight):
    metrics = _by_step(straight.metrics())
    assert sorted(metrics) == [0, 1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        missing = [name for name in RLLM_NAMES if name not in metrics[step]]
        assert not missing, f"step {step} lacks {missing}"
        record = metrics[step]
        assert record["progress/batch"] == step and record["progress/done_frac"] == step / 4
        assert record["progress/lr"] == pytest.approx(1e-3)
        assert record["train/grad_norm"] > 0 and record["perf/rollout_tokens_per_s"] > 0
        # The trainer recomputes the sampler's logprobs on the weights the server had: no gap.
        assert record["train/logprob_abs_diff/mean"] < 1e-4
        assert record["batch/dropped_malformed_sequences"] == 0
    assert all("time/save_checkpoint" in metrics[s] for s in (2, 4))
    assert all(f"val/{src}/pass@{N_VAL}" in metrics[s] for s in (0, 2, 4) for src in VAL_SOURCES)


@pytest.mark.slow
def test_console_shows_a_bar_with_live_reward_the_trainers_lines_and_a_summary(straight):
    """With ``rllm.trainer.logger=[console]``: the bar, the trainer's own line per step (rLLM's, or the
    fallback's short one), and the closing summary."""
    text = straight.text
    if rllm_api.installed():
        step_line = r"step:{step} - .*reward/mean:.*"
    else:
        number = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
        step_line = (
            rf"step {{step}}/4 \| reward {number}( \| val/\S+ {number})* \| kl {number} \| {number} s/step"
        )
    lines = [line.strip() for line in re.split(r"[\r\n]", text) if line.strip().startswith("step")]
    for step in (1, 2, 3, 4):
        assert any(re.fullmatch(step_line.format(step=step), line) for line in lines), (
            f"no line for step {step}"
        )
    assert re.search(r"training: 100%.*4/4.*reward=\d\.\d{3}", text), "no progress bar with the live reward"
    assert "run directory:" in text and f"val/digits_a/pass@{N_VAL}:" in text  # the closing summary


@pytest.mark.slow
def test_no_secret_reaches_logs_the_console_or_hydra_files(digits_runs):
    secrets = [*SECRETS.values(), CONFIG_SECRET]
    runs = [digits_runs.straight, digits_runs.killed, digits_runs.resumed]
    files = {path for run in runs for path in run.run_dir.rglob("*") if path.is_file()}
    files |= {run.output for run in runs}
    assert any(p.parent.name == ".hydra" for p in files)
    leaks = [(str(p), s[:6]) for p in sorted(files) for s in secrets if s.encode() in p.read_bytes()]
    assert not leaks, f"secrets written to {leaks}"
    hydra_config = (digits_runs.straight.run_dir / ".hydra" / "config.yaml").read_text()
    assert "auth" in hydra_config and "api_key" in hydra_config  # masked, not dropped


@pytest.mark.slow
def test_a_png_is_drawn_at_the_end_and_on_demand(straight, tmp_path):
    png = straight.run_dir / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    out = tmp_path / "again.png"
    result = subprocess.run(
        [sys.executable, "-m", "rllm_skyrl.run.plot", str(straight.run_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == out and out.read_bytes()[:4] == b"\x89PNG"
    result = subprocess.run(
        [sys.executable, "-m", "rllm_skyrl.run.plot", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "no metrics.jsonl" in result.stderr


# ---------------------------------------------------------------------------- secrets, unit level


def test_secret_values_come_from_secret_env_vars_and_secret_config_keys():
    from rllm_skyrl.secret_masking import secret_values

    environ = {
        "HF_TOKEN": "hf_abcdefgh",
        "WANDB_API_KEY": "k" * 40,
        "TOKENIZERS_PARALLELISM": "false",
        "PW": "x",
    }
    config = {
        "wandb": {"api_key": "cfg-secret-1"},
        "data": {"max_tokens": "123456789"},
        "auth": {"token": "s"},
    }
    assert secret_values(config, environ) == {"hf_abcdefgh", "k" * 40, "cfg-secret-1"}


def test_masking_covers_log_records_loguru_argv_and_hydra_yaml(capsys):
    import logging

    from loguru import logger as loguru_logger

    from rllm_skyrl.compat import output_masking
    from rllm_skyrl.secret_masking import REDACTED, SecretMasker, _redact_yaml_line

    secret = "hf_unit_test_secret_value"
    masker = SecretMasker([secret])
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "token is %s", (secret,), None)
    masker.filter(record)
    assert record.getMessage() == f"token is {REDACTED}"
    assert _redact_yaml_line("  api_key: abc\n") == f"  api_key: {REDACTED}\n"
    assert _redact_yaml_line("- +credentials.api_key=abc\n") == f"- +credentials.api_key={REDACTED}\n"
    assert _redact_yaml_line("  max_tokens: 64\n") == "  max_tokens: 64\n"
    assert _redact_yaml_line("  hf_token: null\n") == "  hf_token: null\n"

    output_masking.mask([secret])
    sink = loguru_logger.add(sys.stderr, format="{message}")
    try:
        loguru_logger.info(f"Exporting `HF_TOKEN` to ray runtime env: {secret}")
    finally:
        loguru_logger.remove(sink)
    assert secret not in capsys.readouterr().err


def test_logprob_gap_metrics_equal_a_row_by_row_computation():
    """Rows of every length (none, some, the full window) under a random loss mask."""
    import torch

    from rllm_skyrl.run.metrics import logprob_gap_metrics

    generator = torch.Generator().manual_seed(0)
    rows, width = 64, 5
    lengths = torch.randint(0, width + 1, (rows,), generator=generator).tolist()
    outputs = [{"logprobs": torch.randn(n, generator=generator).tolist()} for n in lengths]
    batch = {
        "loss_mask": (torch.rand(rows, width, generator=generator) > 0.3).float(),
        "rollout_logprobs": torch.randn(rows, width, generator=generator),
    }
    gaps, sampled = [], []
    for i, n in enumerate(lengths):
        if n:
            counted = batch["loss_mask"][i, -n:] > 0
            rollout = batch["rollout_logprobs"][i, -n:]
            gaps.append((rollout - torch.tensor(outputs[i]["logprobs"]))[counted])
            sampled.append(rollout[counted])
    gap, entropy = torch.cat(gaps), -torch.cat(sampled).mean().item()
    metrics = logprob_gap_metrics(batch, outputs)
    assert metrics["train/kl_sample_train_v1"] == pytest.approx(gap.abs().mean().item(), rel=1e-6)
    assert metrics["train/kl_sample_train_v2"] == pytest.approx(0.5 * gap.pow(2).mean().item(), rel=1e-6)
    assert metrics["train/logprob_abs_diff/max"] == pytest.approx(gap.abs().max().item(), rel=1e-6)
    assert metrics["train/entropy"] == pytest.approx(entropy, rel=1e-6)
    assert logprob_gap_metrics(batch, [{"logprobs": []}] * rows) == {}
