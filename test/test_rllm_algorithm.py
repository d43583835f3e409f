"""rLLM's algorithm block and the losses its users pick: every key accepted or refused, per-role
losses (``(estimator, loss_fn)`` pairs), gspo under rLLM's trainer, and the solver-judge example
with a loss per role.

Off-policy correction (``rollout_correction``) has its own module, ``test_off_policy_correction.py``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import compose_unified
from rllm_harness import digit_run, requires_rllm

from rllm_skyrl.run.metrics_file import read_metrics
from rllm_skyrl.run_config import resolve_run_config
from rllm_skyrl.update.workers import SkyRLWorkers

REPO = Path(__file__).resolve().parent.parent


def resolve(*overrides: str):
    return resolve_run_config(compose_unified(*overrides))


def test_estimator_map_pairs_give_roles_their_losses_as_rllms_tuples_do():
    run = resolve("+rllm.algorithm.estimator_map={solver:[grpo,ppo],judge:[rloo,cispo]}")
    assert run.estimator_map == {"solver": "grpo", "judge": "rloo"}
    assert run.loss_for("solver").loss_fn == "ppo" and run.loss_for("judge").loss_fn == "cispo"
    mixed = resolve("+rllm.algorithm.estimator_map={solver:[grpo,ppo],judge:rloo}")
    assert mixed.estimator_map == {"solver": "grpo", "judge": "rloo"}
    assert mixed.loss_for("solver").loss_fn == "ppo"  # the judge keeps the loss it has without a pair
    assert mixed.loss_for("judge") == resolve("+rllm.algorithm.estimator_map={judge:rloo}").loss_for("judge")


@requires_rllm
def test_rllms_estimator_map_tuples_give_roles_their_losses():
    from rllm.trainer.algorithms.config import AlgorithmConfig as RllmAlgorithmConfig

    config = RllmAlgorithmConfig(estimator_map={"solver": ("grpo", "ppo"), "judge": ("rloo", "cispo")})
    run = resolve("rllm.algorithm.rollout_correction.tis_mode=token").with_algorithm_config(config)
    assert run.estimator_map == {"solver": "grpo", "judge": "rloo"}
    assert [run.loss_for(role).skyrl_loss_name for role in ("solver", "judge")] == [
        "rllm_skyrl_decoupled:regular",
        "rllm_skyrl_decoupled:cispo",
    ]


@requires_rllm
def test_every_key_of_rllms_algorithm_block_is_in_our_base_config_and_the_readme_table():
    """A key rLLM adds shows up here first: our base config must carry it and the README must say
    whether it is accepted."""
    import rllm
    from omegaconf import OmegaConf

    from rllm_skyrl.run_config.tree import flatten

    theirs = OmegaConf.load(Path(rllm.__file__).parent / "trainer/config/rllm/base.yaml").algorithm
    ours = OmegaConf.load(REPO / "config/rllm/base.yaml").algorithm
    readme = (REPO / "README.md").read_text()
    table = readme[
        readme.index("Every key of rLLM's algorithm block") : readme.index("**Off-policy correction.**")
    ]
    for key in flatten(OmegaConf.to_container(theirs)):
        assert OmegaConf.select(ours, key, default="absent") != "absent", key
        assert f"`{key}`" in table, key


def early_letter_reward(task: dict, action) -> object:
    """1 when the answer starts below "n": about half of the tiny model's first tokens, so nearly
    every group has a reward spread from the first step on."""
    from rllm.rewards.reward_types import RewardOutput

    reward = float((getattr(action, "action", action) or "")[:1].lower() < "n")
    return RewardOutput(reward=reward, is_correct=reward > 0)


@pytest.mark.slow
@requires_rllm
@pytest.mark.usefixtures("ray_cluster")
def test_gspo_trains_under_rllms_trainer(tmp_path, monkeypatch):
    """``rllm.algorithm.loss_fn=gspo`` from rLLM's own config reaches SkyRL's gspo loss, which
    updates the policy every step."""
    losses_sent: list[str | None] = []
    original = SkyRLWorkers.forward_backward

    def recording(self, role, batch, *args, **kwargs):
        losses_sent.append(kwargs.get("loss_fn"))
        return original(self, role, batch, *args, **kwargs)

    monkeypatch.setattr(SkyRLWorkers, "forward_backward", recording)
    records = digit_run(
        tmp_path,
        "rllm.algorithm.loss_fn=gspo",
        "training.group_size=8",
        "data.train_batch_size=4",
        "rllm.trainer.total_batches=3",
        reward=early_letter_reward,
    )
    assert [r["step"] for r in records] == [1, 2, 3] and losses_sent == ["gspo"] * 3
    assert all(r["train/grad_norm"] > 0 and math.isfinite(r["train/policy_loss"]) for r in records)


@pytest.mark.slow
def test_solver_judge_trains_each_role_with_its_own_loss(tmp_path):
    """The solver-judge example with ``[estimator, loss_fn]`` per role (rLLM's tuples): both roles
    train, each role's rows with its loss, and each role's share of the loss is named in the metrics."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "examples.solver_judge.train",
            "rllm.trainer.total_batches=2",
            "rllm.trainer.test_freq=0",
            "+rllm.algorithm.estimator_map={solver:[grpo,ppo],judge:[grpo,cispo]}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in read_metrics(run_dir) if "progress/batch" in r]
    assert len(records) == 2
    for record in records:
        per_role = {key for key in record if key.startswith("train/policy_loss/")}
        assert per_role == {"train/policy_loss/solver/ppo", "train/policy_loss/judge/cispo"}
        assert all(math.isfinite(record[key]) for key in per_role)
        assert {"reward/solver/mean", "reward/judge/mean", "train/grad_norm"} <= set(record)
