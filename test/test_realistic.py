"""Opt-in (slow): the examples on SmolLM2-135M-Instruct, a real pretrained model, on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)
def test_simple_math_on_smollm2(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.simple_math.train",
            "model.path=smollm2",
            "rllm.data.train_batch_size=4",
            "training.group_size=4",
            "rllm.data.max_response_length=8",
            "training.learning_rate=1e-6",
            "rllm.trainer.total_batches=2",
            "rllm.trainer.test_freq=0",
            "skyrl.trainer.micro_train_batch_size_per_gpu=4",
            "skyrl.trainer.micro_forward_batch_size_per_gpu=4",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=ROOT,
        env={**os.environ},
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # A real tied-embedding model: trainer and inference server must agree on the policy.
    assert all(r["train/logprob_abs_diff/mean"] < 1e-3 for r in records), [
        r["train/logprob_abs_diff/mean"] for r in records
    ]
