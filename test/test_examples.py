"""Every example runs from its entry point on CPU with the tiny model (a few steps each), under
rLLM's trainer where rLLM is installed, and the quickstart also as on a machine without rLLM."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A module run as on a machine without rLLM: ``import rllm`` fails and ``find_spec("rllm")`` is None.
WITHOUT_RLLM = """
import runpy, sys
sys.modules["rllm"] = None
module, sys.argv[1:] = sys.argv[1], sys.argv[2:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run_example(args: list[str], run_dir: Path, timeout: float = 420) -> tuple[list[dict], str]:
    """The run's records, and what it printed on the console (stdout, then stderr)."""
    env = {**os.environ, "RLLM_SKYRL_CACHE": os.environ["RLLM_SKYRL_CACHE"], "WANDB_MODE": "offline"}
    result = subprocess.run(
        [*args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"run directory: {run_dir}" in result.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, result.stdout + result.stderr


def check_quickstart(records: list[dict], console: str) -> None:
    """Progress, summary, metrics.jsonl with step and reward; the trainer's own output off the console."""
    train = [r for r in records if "progress/batch" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all("reward/mean" in r and "time/step" in r for r in train)
    # rLLM's schedule: no periodic validation at the step that ends training, one after the loop.
    assert records[-1]["step"] == 3 and "val/digit_echo/pass@1" in records[-1]
    assert "val/digit_echo/pass@4" in records[-1]
    assert "training: 100%" in console and "reward=" in console and "reward/mean:" in console
    assert "┃" not in console and "Generating trajectories" not in console  # rLLM's tables and bars


def test_simple_math_script(tmp_path):
    """The README's train command, shortened, under rLLM's trainer where rLLM is installed."""
    records, console = run_example(
        ["bash", "examples/simple_math/train.sh", "rllm.trainer.total_batches=3", "rllm.trainer.test_freq=3"],
        tmp_path / "run",
    )
    check_quickstart(records, console)
    rllm_trained = "groups/num_trajs_before_filter" in records[1]  # a metric only rLLM's trainer logs
    assert rllm_trained == (importlib.util.find_spec("rllm") is not None)
    if rllm_trained:  # its per-step tables went to the run directory
        assert "Training Config" in (tmp_path / "run" / "trainer_output.log").read_text()


@pytest.mark.slow
def test_simple_math_runs_on_the_fallback_without_rllm(tmp_path):
    """The same example code, as on a machine where rLLM is not installed: the standalone trainer."""
    records, console = run_example(
        [
            sys.executable,
            "-c",
            WITHOUT_RLLM,
            "examples.simple_math.train",
            "rllm.trainer.total_batches=3",
            "rllm.trainer.test_freq=3",
        ],
        tmp_path / "run",
    )
    check_quickstart(records, console)
    assert "groups/num_trajs" in records[1] and "groups/num_trajs_before_filter" not in records[1]
    assert "is not available" not in console  # rLLM's config source, expected to be missing


@pytest.mark.slow
def test_solver_judge_trains_both_roles(tmp_path):
    records, _ = run_example(
        [
            sys.executable,
            "-m",
            "examples.solver_judge.train",
            "rllm.trainer.total_batches=2",
            "rllm.trainer.test_freq=0",
        ],
        tmp_path / "run",
    )
    last = records[-1]
    assert {"reward/solver/mean", "reward/judge/mean"} <= set(last)
    # 8 tasks x 16 rollouts: 2 solver trajectories and 1 judge trajectory each, all trained.
    assert last["groups/num_groups"] == 16
    assert last["batch/num_rows"] == 8 * 16 * 3


@pytest.mark.slow  # the example as it ships: 60 steps, after a teacher and a student start are trained
def test_distill_script_serves_a_teacher_and_the_student_learns(tmp_path, monkeypatch):
    """One command: the teacher trained, served by the CPU server, scored through rLLM's OpenAIEngine;
    the student's reward rises and its reverse KL to the teacher falls."""
    monkeypatch.setenv("TEACHER_DIR", str(tmp_path / "teacher"))
    monkeypatch.setenv("STUDENT_DIR", str(tmp_path / "student"))
    records, console = run_example(["bash", "examples/distill/train.sh"], tmp_path / "run", timeout=1800)
    assert "greedy accuracy 1.00" in console  # the teacher learnt the digit task
    train = [r for r in records if "progress/batch" in r]
    assert [r["step"] for r in train] == list(range(1, 61))
    # Every response token scored by the teacher: 16 tasks x 16 samples x at most 2 tokens.
    assert all(16 * 16 <= r["distill/tokens"] <= 16 * 16 * 2 for r in train)
    reward = [r["reward/mean"] for r in train]
    kl = [r["distill/reverse_kl"] for r in train]
    print("\nreward per step:", " ".join(f"{x:.2f}" for x in reward))
    print("reverse KL per step:", " ".join(f"{x:.2f}" for x in kl))
    assert statistics.mean(reward[:10]) <= 0.3 and statistics.mean(reward[-10:]) >= 0.7
    assert statistics.mean(kl[-10:]) < 0.5 * statistics.mean(kl[:10])


@pytest.mark.slow
def test_distill_script_takes_a_teacher_with_a_tokenizer_of_its_own(tmp_path, monkeypatch):
    """``teacher.shared_tokenizer=false``: rLLM re-renders each answer for the teacher's tokenizer and
    aligns its logprobs to the student's tokens; every student token is still scored."""
    from transformers import AutoTokenizer

    from examples.distill.teacher import train_teacher
    from rllm_skyrl.tiny_model import TinyModelConfig, build_tiny_model

    teacher = train_teacher(tmp_path / "teacher", shape=TinyModelConfig(vocab_size=384))
    student, other = (AutoTokenizer.from_pretrained(d) for d in (build_tiny_model(), teacher))
    text = student.decode([len(student) - 1])  # a merge the smaller vocabulary lacks
    assert len(student.encode(text)) == 1 < len(other.encode(text))
    monkeypatch.setenv("TEACHER_DIR", str(teacher))
    monkeypatch.setenv("STUDENT_DIR", str(tmp_path / "student"))
    overrides = ["teacher.shared_tokenizer=false", "rllm.trainer.total_batches=2", "training.group_size=2"]
    records, _ = run_example(["bash", "examples/distill/train.sh", *overrides], tmp_path / "run", timeout=900)
    train = [r for r in records if "progress/batch" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(16 * 2 <= r["distill/tokens"] <= 16 * 2 * 2 for r in train)
    assert all(0 < r["distill/reverse_kl"] < 50 for r in train)


@pytest.mark.slow  # a whole SFT run (SkyRL's SFT trainer) before the RL steps
def test_sft_script_fine_tunes_then_runs_rl_from_the_export(tmp_path):
    """examples/sft/train.sh, shortened: rLLM's AgentSFTTrainer on SkyRL, then AgentTrainer GRPO."""
    pytest.importorskip("rllm", reason="the example is rLLM's SFT and RL entry points")
    out = tmp_path / "out"
    env = {**os.environ, "SFT_OUT": str(out), "RL_STEPS": "2", "WANDB_MODE": "offline"}
    result = subprocess.run(
        ["bash", "examples/sft/train.sh", "--epochs", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sft = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sft if "train_mean_nll" in r] == [1, 2, 3, 4, 5]
    model_dir = out / "sft" / "hf_exports" / "global_step_5" / "policy"
    assert f"HF model: {model_dir}" in result.stdout
    rl = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rl if "reward/mean" in r] == [1, 2]
