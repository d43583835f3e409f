"""SFT through ModelRegistry (examples/sft): held-out loss drops, and SFT-then-GRPO beats GRPO alone."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import compose_example, hf_logprobs, run_dirs

from examples.sft.task import digit_reward, make_rows
from examples.sft.train import encode, train_sft
from rllm_skyrl.run.metrics_file import read_metrics
from rllm_skyrl.training_run import train

pytestmark = pytest.mark.usefixtures("ray_cluster")


def sft_config(root: Path, *overrides: str):
    return compose_example(
        "sft",
        f"sft.data_dir={root}/data",
        f"sft.export_dir={root}/hf_model",
        f"training.default_local_dir={root}/checkpoints",
        *overrides,
    )


def rl_config(root: Path, *overrides: str):
    """The digit example's GRPO config, shortened; RL runs are compared under the same settings."""
    return compose_example(
        "simple_math",
        *run_dirs(root),
        "rllm.trainer.total_batches=30",
        "rllm.trainer.test_freq=0",
        "training.group_size=8",
        # The digit example's 1e-3 is tuned for learning from scratch; on a memorised SFT
        # model it erodes the answers (measured: reward 0.93 -> ~0.5 in 30 steps).
        "training.learning_rate=3e-4",
        *overrides,
    )


def heldout_loss_of_export(export_dir: Path, heldout_path: Path) -> float:
    """Mean per-token CE of the held-out answers under a plain HF forward of the exported model."""
    from transformers import AutoTokenizer

    frame = pd.read_parquet(heldout_path)
    pairs = encode(
        AutoTokenizer.from_pretrained(export_dir), list(zip(frame["prompt"], frame["response"], strict=True))
    )
    logprobs = hf_logprobs(export_dir, [p for p, _ in pairs], [r for _, r in pairs])
    return -float(torch.cat(logprobs).sum()) / sum(len(r) for _, r in pairs)


def test_sft_heldout_loss_drops_and_the_export_loads(tmp_path):
    result = train_sft(
        sft_config(tmp_path, "sft.steps=40", "sft.eval_every=20", "training.learning_rate=3e-3")
    )
    steps = [step for step, _ in result.heldout_losses]
    assert steps == [0, 20, 40]
    first, last = result.heldout_losses[0][1], result.heldout_losses[-1][1]
    assert last < 0.4 * first, result.heldout_losses
    heldout = tmp_path / "data" / "heldout.parquet"
    frame = pd.read_parquet(heldout)
    assert list(frame.columns) == ["prompt", "response", "data_source"] and len(frame) == 20
    train = pd.read_parquet(tmp_path / "data" / "train.parquet")
    assert not set(frame["prompt"]) & set(train["prompt"]), "held-out pairs are never trained on"
    # The exported directory is a plain HF model: it reproduces the last held-out loss.
    assert heldout_loss_of_export(result.export_dir, heldout) == pytest.approx(last, rel=1e-3)


@pytest.mark.slow
def test_sft_then_grpo_beats_grpo_from_scratch(tmp_path):
    """Same 30 GRPO steps on the addition task; only the starting weights differ."""
    started = time.perf_counter()
    sft = train_sft(sft_config(tmp_path / "sft"))
    rewards = {}
    for name, model_path in (("scratch", "tiny"), ("sft", str(sft.export_dir))):
        cfg = rl_config(tmp_path / name, f"model.path={model_path}")
        run_dir = train(
            cfg,
            workflow_class="examples.simple_math.workflow.AskOnceWorkflow",
            workflow_args={"reward_function": digit_reward},
            train_dataset=make_rows(cfg.dataset.train_rows, seed=cfg.dataset.seed),
        )
        rewards[name] = [r["reward/mean"] for r in read_metrics(run_dir) if "reward/mean" in r]
    print(f"SFT + 2 x 30 GRPO steps: {time.perf_counter() - started:.0f} s")
    assert len(rewards["scratch"]) == len(rewards["sft"]) == 30
    scratch, tuned = statistics.mean(rewards["scratch"][-10:]), statistics.mean(rewards["sft"][-10:])
    assert scratch < 0.3, rewards["scratch"]
    assert tuned > 0.7 and tuned > scratch + 0.4, rewards
