"""PPO with a critic (GAE) on the digit task: the policy learns and the critic's value loss falls."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from examples.simple_math.task import make_rows, reward_fn
from rllm_skyrl import launcher
from rllm_skyrl.run_log import read_metrics
from rllm_skyrl.standalone.workflow import SingleTurnWorkflow

EXAMPLE_DIR = Path(__file__).resolve().parent.parent / "examples" / "simple_math"
STEPS = 220


def windows(values: list[float], size: int = 10) -> list[float]:
    return [statistics.mean(values[i : i + size]) for i in range(0, len(values) - size + 1, size)]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_ppo_with_critic_learns_and_the_critic_fits(tmp_path):
    with initialize_config_dir(config_dir=str(EXAMPLE_DIR), version_base=None):
        cfg = compose(
            "config",
            overrides=[
                f"training.default_local_dir={tmp_path}/ckpt",
                f"rllm.trainer.run_dir={tmp_path}/run",
                f"rllm.trainer.total_batches={STEPS}",
                "rllm.trainer.test_freq=0",
                "rllm.algorithm.adv_estimator=gae",
                "training.critic_learning_rate=1e-3",
            ],
        )
    run_dir = launcher.run(
        cfg,
        workflow_class=SingleTurnWorkflow,
        workflow_args={"reward_fn": reward_fn},
        train_dataset=make_rows(cfg.dataset.train_rows, seed=cfg.dataset.seed),
    )
    records = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    assert len(records) == STEPS
    rewards = [r["reward/mean"] for r in records]
    assert statistics.mean(rewards[:10]) <= 0.3
    assert statistics.mean(rewards[-10:]) >= 0.8, windows(rewards)
    value_loss = windows([r["critic/value_loss"] for r in records])
    reward_variance = statistics.mean(r["reward/std"] ** 2 for r in records[-10:])
    # The critic fits the returns: its loss ends far below its peak and below what a constant
    # prediction would cost (half the reward variance, for a squared-error value loss).
    assert value_loss[-1] < 0.25 * max(value_loss), value_loss
    assert value_loss[-1] < 0.5 * reward_variance, (value_loss[-1], reward_variance)
