"""On-policy distillation learns: a random tiny student distilled from a teacher that knows the digit
task, the teacher served by this package's CPU server and scored through rLLM's ``OpenAIEngine``.

One shared run (``examples/distill/train.sh``); the teacher is trained in the module's fixture.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
STEPS = 80
OVERRIDES = ["training.learning_rate=1e-2", "training.group_size=32", "rllm.workflow.n_parallel_tasks=512"]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    from examples.distill.teacher import train_teacher

    return train_teacher(tmp_path_factory.mktemp("teacher") / "model")


@pytest.fixture(scope="module")
def curve(teacher_dir, tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("distill") / "run"
    result = subprocess.run(
        [
            "bash",
            "examples/distill/train.sh",
            f"rllm.trainer.total_batches={STEPS}",
            *OVERRIDES,
            f"hydra.run.dir={run_dir}",
        ],
        cwd=ROOT,
        env={**os.environ, "TEACHER_DIR": str(teacher_dir), "WANDB_MODE": "offline"},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "progress/batch" in r]


def window(curve: list[dict], key: str, steps: slice) -> float:
    values = [r[key] for r in curve[steps]]
    return sum(values) / len(values)


def test_every_step_logs_reward_and_reverse_kl(curve):
    assert [r["step"] for r in curve] == list(range(1, STEPS + 1))
    assert all("reward/mean" in r and "distill/reverse_kl" in r for r in curve)


def test_the_student_reward_rises_from_chance(curve):
    assert window(curve, "reward/mean", slice(0, 5)) <= 0.3
    assert window(curve, "reward/mean", slice(-10, None)) >= 0.7


def test_the_reverse_kl_to_the_teacher_falls(curve):
    first, last = (
        window(curve, "distill/reverse_kl", slice(0, 5)),
        window(curve, "distill/reverse_kl", slice(-10, None)),
    )
    assert last < 0.5 * first, (first, last)
