"""rLLM's own example scripts, written for its tinker backend, run with ``rllm/backend=skyrl``.

Each script is read from the rLLM source this backend conforms to and run as its author wrote it,
with three kinds of change only: the backend group, the model (the tiny test model instead of a
hub id this machine cannot download) and the sizes a 2-core CPU can afford. Every other override
(loss, sampling, ``model.lora_rank``, workflow and trainer keys) goes through unchanged, so a key
this backend did not accept would fail the run.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from rllm_harness import requires_rllm

pytestmark = requires_rllm

# Sizes for a 2-core CPU. Prompt and context lengths stay as the scripts set them: the test
# model is built with a context that holds them.
SCALE = {
    "model.name": "{model}",
    "training.group_size": "2",
    "data.train_batch_size": "2",
    "data.val_batch_size": "4",
    "data.max_response_length": "16",
    "rllm.workflow.n_parallel_tasks": "8",
    "rllm.trainer.logger": "[console]",
}


def rllm_source() -> Path:
    import rllm

    return Path(rllm.__file__).resolve().parent.parent


def script_command(script: Path) -> tuple[list[str], list[str]]:
    """The script's python command split into (program arguments, Hydra overrides)."""
    text = script.read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith("python")]
    words = [w for w in shlex.split(line) if w != "$@"]
    first_override = next(i for i, w in enumerate(words) if "=" in w)
    return words[1:first_override], words[first_override:]


def swapped(overrides: list[str], model: str, run_dir: Path) -> list[str]:
    out = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "rllm/backend":
            assert value == "tinker", override
            value = "skyrl"
        value = SCALE.get(key, value).format(model=model)
        out.append(f"{key}={value}")
    given = {o.partition("=")[0] for o in out}
    out += [f"{k}={v.format(model=model)}" for k, v in SCALE.items() if k not in given]
    return out + [
        "rllm.trainer.total_batches=2",
        f"rllm.trainer.run_dir={run_dir}/run",
        f"training.default_local_dir={run_dir}/ckpt",
    ]


@pytest.fixture(scope="module")
def long_context_model() -> str:
    """The tiny test model with an 8K context (rotary positions: the size costs nothing)."""
    from rllm_skyrl.tiny_model import TinyModelConfig, build_tiny_model

    return str(build_tiny_model(TinyModelConfig(max_position_embeddings=8192)))


@pytest.fixture(scope="module")
def countdown_dataset() -> None:
    """A small offline countdown dataset, in the row format of rLLM's prepare_countdown_data.py."""
    from rllm.data.dataset import DatasetRegistry

    rng = random.Random(0)
    for split, count in (("train", 8), ("test", 4)):
        rows = []
        for _ in range(count):
            nums = [rng.randint(1, 20) for _ in range(3)]
            target = nums[0] + nums[1] - nums[2]
            rows.append(
                {
                    "question": f"Using the numbers {', '.join(map(str, nums))}, reach {target}. "
                    "Answer within <answer>...</answer>.",
                    "ground_truth": str(target),
                    "data_source": "countdown",
                    "target": target,
                    "nums": nums,
                }
            )
        DatasetRegistry.register_dataset("countdown", rows, split=split)


def run_example(script: Path, cwd: Path, model: str, run_dir: Path) -> dict:
    program, overrides = script_command(script)
    command = [sys.executable, *[a for a in program if a != "-u"], *swapped(overrides, model, run_dir)]
    result = subprocess.run(
        command, cwd=cwd, env=dict(os.environ), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"{shlex.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    records = [json.loads(line) for line in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"records": records, "output": result.stdout + result.stderr}


def check_trained(records: list[dict]) -> None:
    steps = [r for r in records if "time/step" in r]
    assert [r["step"] for r in steps] == [1, 2], records
    assert all("train/kl_sample_train_v1" in r for r in steps), "no trajectory was trained on"
    assert any("val/countdown/pass@1" in r for r in records), records


@pytest.mark.slow
def test_countdown_sync_script_runs_with_the_backend_swapped(tmp_path, long_context_model, countdown_dataset):
    """examples/countdown: its python file even says ``AgentTrainer(backend="tinker")``."""
    root = rllm_source()
    script = root / "examples/countdown/unified_trainer/train_countdown_unified_tinker_sync.sh"
    run = run_example(script, root, long_context_model, tmp_path)
    check_trained(run["records"])
    assert "AgentTrainer(backend='tinker')" in run["output"]


@pytest.mark.slow
def test_solver_judge_cookbook_runs_with_the_backend_swapped(tmp_path, long_context_model, countdown_dataset):
    """cookbooks/workflow/solver_judge: a multi-agent workflow (two solutions, then a judge)."""
    cookbook = rllm_source() / "cookbooks/workflow/solver_judge"
    run = run_example(cookbook / "train_tinker.sh", cookbook, long_context_model, tmp_path)
    check_trained(run["records"])


# The fully-async script's sizes for a 2-core CPU: updates of two task groups, one per forward-backward.
ASYNC_SCALE = {
    "rllm.async_training.mini_batch_size": "2",
    "rllm.async_training.fwd_bwd_group_size": "1",
    "rllm.trainer.total_batches": "3",  # rLLM's async loop stops one step before: two updates
}


@pytest.mark.slow
def test_countdown_fully_async_script_runs_with_the_backend_swapped(
    tmp_path, long_context_model, countdown_dataset
):
    """examples/countdown's fully-async script: staleness 0.5, partial rollouts (weights sync while
    requests are in flight), validation before training."""
    root = rllm_source()
    script = root / "examples/countdown/unified_trainer/train_countdown_unified_tinker_async.sh"
    program, overrides = script_command(script)
    assert {"rllm.async_training.enable=true", "rllm.async_training.partial_rollout=true"} <= set(overrides)
    scaled = [
        f"{key}={ASYNC_SCALE.get(key, value)}"
        for key, value in (o.partition("=")[::2] for o in swapped(overrides, long_context_model, tmp_path))
    ]
    command = [sys.executable, *[a for a in program if a != "-u"], *scaled]
    result = subprocess.run(
        command, cwd=root, env=dict(os.environ), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"{shlex.join(command)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step" in r]
    assert [r["step"] for r in steps] == [1, 2], records
    assert all("train/kl_sample_train_v1" in r for r in steps), "no trajectory was trained on"
    assert [r["async/weight_version"] for r in steps] == [0, 1]  # the first update synced before the second
    assert any("val/countdown/pass@1" in r for r in records), records
