"""The GPU check without a GPU: it refuses politely, and its summary and bounds judge runs right."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bench import gpu_check
from rllm_skyrl.cli import plan

REPO = Path(__file__).resolve().parent.parent


def records(rewards, gaps, step_time=1.0, sync=0.2):
    return [
        {
            "step": i + 1,
            "reward/mean": reward,
            "time/step": step_time,
            "time/weight_sync": sync,
            gpu_check.GAP: gap,
            "train/kl_sample_train_v1": gap / 10,
        }
        for i, (reward, gap) in enumerate(zip(rewards, gaps, strict=True))
    ]


LEARNING = [0.0, 0.01, 0.0, 0.01, 0.0] + [0.05] * 20 + [0.1, 0.12, 0.1, 0.11, 0.12]


def test_healthy_run_passes():
    result = gpu_check.summarize("quickstart", "separate", records(LEARNING, [0.012] * 30), must_learn=True)
    assert result.problems == []
    assert result.steps == 30
    assert result.reward_first == pytest.approx(0.004) and result.reward_last == pytest.approx(0.11)
    assert result.gap_start == pytest.approx(0.012) and result.gap_trained == pytest.approx(0.012)
    assert result.sync_seconds == pytest.approx(0.2) and result.step_seconds == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("rewards", "gaps", "must_learn", "problem"),
    [
        (LEARNING, [0.2] * 30, True, "gap at step 1 0.200 > 0.05"),
        # An untied head: same weights at step 1, served and trained models part after each sync.
        (LEARNING, [0.01] + [0.01 + 0.002 * i for i in range(29)], True, "grew from 0.010"),
        (LEARNING, [0.01] + [0.06] * 29, True, "after weight syncs 0.060 > 0.05"),
        ([0.003] * 30, [0.01] * 30, True, "less than +0.02 over 30 steps"),
    ],
    ids=["numerics off", "gap grows with training", "synced weights off", "no learning"],
)
def test_bad_runs_fail_with_the_reason(rewards, gaps, must_learn, problem):
    result = gpu_check.summarize("run", "separate", records(rewards, gaps), must_learn)
    assert any(problem in p for p in result.problems), result.problems


def test_learning_is_only_required_where_asked():
    flat = records([0.003] * 8, [0.01] * 8)
    assert gpu_check.summarize("smollm2", "separate", flat, must_learn=False).problems == []


def test_missing_metrics_are_problems():
    assert gpu_check.summarize("run", "separate", [], True).problems == ["no training step was logged"]
    no_gap = [{k: v for k, v in r.items() if k != gpu_check.GAP} for r in records(LEARNING, [0.0] * 30)]
    assert "rollout logprobs missing" in gpu_check.summarize("run", "separate", no_gap, True).problems[0]


def test_table_reports_every_run_what_was_not_checked_and_the_verdict():
    good = gpu_check.summarize("quickstart", "colocated", records(LEARNING, [0.012] * 30), True)
    bad = gpu_check.summarize("smollm2", "colocated", records([0.1] * 8, [0.01] + [0.2] * 7), False)
    text = gpu_check.table([good, bad], ["separate placement needs 2 GPUs"])
    lines = text.splitlines()
    assert lines[2].startswith("quickstart  colocated") and lines[2].endswith("ok")
    assert lines[3].startswith("smollm2") and lines[3].endswith("FAIL")
    assert "smollm2: logprob gap after weight syncs 0.200 > 0.05" in text
    assert "not checked: separate placement needs 2 GPUs" in text
    assert lines[-1] == "GPU check FAILED"
    assert gpu_check.table([good], [])[-len("GPU check passed") :] == "GPU check passed"


def test_per_step_lines_show_reward_time_gap_and_sync():
    text = gpu_check.step_lines(records([0.5], [0.0123], step_time=2.5, sync=0.75))
    assert text.splitlines()[1].split() == ["1", "0.500", "2.50", "0.0123", "1.23e-03", "0.750"]


def test_one_gpu_runs_everything_colocated_and_says_what_it_skipped():
    cases, skipped = gpu_check.plan_cases(1)
    assert [c.name for c in cases] == ["quickstart", "smollm2"]
    assert all(c.gpus == 1 and "skyrl.trainer.placement.colocate_all=true" in c.overrides for c in cases)
    assert len(skipped) == 1 and "needs 2 GPUs" in skipped[0]
    cases, skipped = gpu_check.plan_cases(8)
    assert [(c.name, c.gpus) for c in cases] == [("quickstart", 2), ("colocated", 1), ("smollm2", 2)]
    assert skipped == []


@pytest.mark.parametrize("num_gpus", [1, 2])
def test_every_case_is_a_config_skyrl_accepts_on_its_gpus(num_gpus, monkeypatch):
    """The runs' overrides compose, resolve and pass SkyRL's validate_cfg, on the GPUs they get."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for case in gpu_check.plan_cases(num_gpus)[0]:
        text = plan([*gpu_check.COMMON, *case.overrides], config_dir=str(REPO / "config"))
        assert f"GPUs needed: {case.gpus}" in text, case.name


def test_module_without_cuda_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "cuda_devices", lambda: 0)
    monkeypatch.setattr(gpu_check, "driver_gpus", lambda: [])
    assert gpu_check.main([]) == 0
    assert "No CUDA GPU here" in capsys.readouterr().out


def test_module_with_a_gpu_torch_cannot_use_fails_with_the_driver_hint(monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "cuda_devices", lambda: 0)
    monkeypatch.setattr(gpu_check, "driver_gpus", lambda: ["GPU 0: NVIDIA A100 (UUID: x)"])
    assert gpu_check.main([]) == 1
    assert "cannot use them" in capsys.readouterr().out


def test_script_without_a_gpu_installs_nothing_and_exits_0(tmp_path):
    """``scripts/gpu_check.sh`` on this machine: a failing (or absent) nvidia-smi means no GPU."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    nvidia_smi = fake_bin / "nvidia-smi"
    nvidia_smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\nexit 9\n")
    nvidia_smi.chmod(nvidia_smi.stat().st_mode | stat.S_IEXEC)
    venv = tmp_path / "venv"
    env = {**os.environ, "PATH": f"{fake_bin}:/usr/bin:/bin", "RLLM_SKYRL_VENV": str(venv)}
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "No NVIDIA GPU here" in result.stdout
    assert not venv.exists()  # nothing created, nothing installed


def test_module_runs_as_a_command_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs CUDA to be absent")
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "nothing to check" in result.stdout
