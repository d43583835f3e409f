"""rLLM-style outcome advantages, SkyRL's GAE and SkyRL's loss-reduction pre-scaling."""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
import pytest
import torch
from helpers import Step, Trajectory, TrajectoryGroup, group_of
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from skyrl.backends.skyrl_train.utils.ppo_utils import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_rloo_outcome_advantage,
    ppo_policy_loss,
)
from skyrl.train.config import AlgorithmConfig

from rllm_skyrl.data.adapter import BatchConfig, trajectory_groups_to_batch
from rllm_skyrl.run_config.losses import resolve_loss
from rllm_skyrl.update.advantages import (
    LOSS_REDUCTIONS,
    BatchAdvantages,
    add_gae_advantages,
    apply_loss_reduction,
    compute_group_advantages,
    outcome_advantages,
    zero_variance,
)

HYPOTHESIS = settings(max_examples=40, deadline=None)
EPS = 1e-6


# Plain per-group references written from rLLM's definitions (rllm/trainer/algorithms).
def ref_grpo(rewards: np.ndarray, norm_by_std: bool) -> np.ndarray:
    mean, std = (0.0, 1.0) if len(rewards) <= 1 else (rewards.mean(), rewards.std())
    return (rewards - mean) / (std + EPS) if norm_by_std else rewards - mean


def ref_rloo(rewards: np.ndarray) -> np.ndarray:
    n = len(rewards)
    return rewards if n <= 1 else n / (n - 1) * (rewards - rewards.mean())


def ref_reinforce_pp_baseline(groups: list[np.ndarray]) -> list[np.ndarray]:
    centered = [g - g.mean() for g in groups]
    std = np.concatenate(centered).std()
    return [c / (std + EPS) for c in centered]


reward_groups = st.lists(
    st.lists(st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-5, 5)), min_size=1, max_size=8),
    min_size=1,
    max_size=6,
)


def as_tensors(groups: list[list[float]]) -> list[torch.Tensor]:
    return [torch.tensor(g, dtype=torch.float64) for g in groups]


@HYPOTHESIS
@given(groups=reward_groups, norm_by_std=st.booleans())
def test_outcome_estimators_match_rllm_definitions(groups, norm_by_std):
    arrays = [np.array(g) for g in groups]
    expected = {
        "grpo": [ref_grpo(a, norm_by_std) for a in arrays],
        "rloo": [ref_rloo(a) for a in arrays],
        "reinforce": arrays,
        "reinforce_plus_plus_baseline": ref_reinforce_pp_baseline(arrays),
    }
    for estimator, reference in expected.items():
        ours = outcome_advantages(as_tensors(groups), estimator, norm_by_std=norm_by_std, epsilon=EPS)
        for advantages_G, expected_G in zip(ours, reference, strict=True):
            np.testing.assert_allclose(advantages_G.numpy(), expected_G, rtol=1e-9, atol=1e-9)


@HYPOTHESIS
@given(groups=st.lists(st.lists(st.floats(-5, 5), min_size=2, max_size=8), min_size=1, max_size=5))
def test_grpo_and_rloo_agree_with_skyrl_where_definitions_meet(groups):
    rewards_N = torch.tensor([r for g in groups for r in g], dtype=torch.float32)
    index = np.array([i for i, g in enumerate(groups) for _ in g])
    token_rewards_BT, mask_BT = rewards_N[:, None].clone(), torch.ones(len(rewards_N), 1)

    ours = torch.cat(outcome_advantages(as_tensors(groups), "grpo", norm_by_std=False)).float()
    skyrl, _ = compute_grpo_outcome_advantage(
        token_rewards_BT.clone(), mask_BT, index, grpo_norm_by_std=False
    )
    torch.testing.assert_close(ours, skyrl[:, 0], atol=1e-4, rtol=1e-4)

    ours = torch.cat(outcome_advantages(as_tensors(groups), "rloo")).float()
    skyrl, _ = compute_rloo_outcome_advantage(token_rewards_BT.clone(), mask_BT, index)
    torch.testing.assert_close(ours, skyrl[:, 0], atol=1e-4, rtol=1e-4)

    # With std normalisation SkyRL divides by the unbiased std, rLLM (and we) by the population std.
    ours = torch.cat(outcome_advantages(as_tensors(groups), "grpo", epsilon=0.0)).float()
    skyrl, _ = compute_grpo_outcome_advantage(token_rewards_BT.clone(), mask_BT, index, epsilon=0.0)
    sizes = torch.tensor([len(g) for g in groups for _ in g], dtype=torch.float32)
    spread = torch.tensor([np.std(g) > 1e-3 for g in groups for _ in g])
    bessel = (sizes / (sizes - 1)).sqrt()
    torch.testing.assert_close(ours[spread], (skyrl[:, 0] * bessel)[spread], atol=1e-3, rtol=1e-3)


def test_singleton_groups_follow_rllm_not_skyrl():
    (grpo,) = outcome_advantages([torch.tensor([0.7])], "grpo", epsilon=0.0)
    (rloo,) = outcome_advantages([torch.tensor([0.7])], "rloo")
    (rpp,) = outcome_advantages([torch.tensor([0.7])], "reinforce_plus_plus_baseline")
    assert grpo.item() == pytest.approx(0.7) and rloo.item() == pytest.approx(0.7) and rpp.item() == 0.0
    skyrl, _ = compute_rloo_outcome_advantage(torch.tensor([[0.7]]), torch.ones(1, 1), np.array([0]))
    assert skyrl.item() == 0.0  # the documented difference


def test_nonfinite_rewards_are_left_out_of_baselines():
    with_nan, without = outcome_advantages(
        [torch.tensor([1.0, math.nan, 0.0, 0.0]), torch.tensor([1.0, 0.0, 0.0])], "grpo"
    )
    assert with_nan[1].item() == 0.0
    torch.testing.assert_close(with_nan[[0, 2, 3]], without)


def test_unknown_estimator_lists_the_known_ones():
    with pytest.raises(
        ValueError, match="unknown advantage estimator 'gae'.*grpo.*reinforce_plus_plus_baseline"
    ):
        outcome_advantages([torch.tensor([1.0])], "gae")


def make_group(task: str, role: str, rewards: list[float | None]) -> TrajectoryGroup:
    trajectories = [
        Trajectory([Step([1], [2])], reward=r, name=role, uid=f"{task}-{i}") for i, r in enumerate(rewards)
    ]
    return TrajectoryGroup(trajectories, f"{task}:{role}")


def test_group_advantages_per_role_with_stats():
    groups = [
        make_group("t0", "solver", [1.0, 0.0, 1.0, 0.0]),
        make_group("t1", "solver", [1.0, 1.0, 1.0, 1.0]),  # solved by all: no signal
        make_group("t2", "solver", [0.0, 0.0, 0.0, 0.0]),  # solved by none: no signal
        make_group("t0", "judge", [1.0, 0.0]),
        make_group("t1", "judge", [0.5, math.nan]),
    ]
    result = compute_group_advantages(groups, "grpo", estimator_map={"judge": "reinforce"})
    np.testing.assert_allclose(result.advantages_by_group[0].numpy(), [1, -1, 1, -1], atol=1e-5)
    assert result.advantages_by_group[1].abs().sum() == 0
    assert result.advantages_by_group[3].tolist() == [1.0, 0.0]  # judge uses plain REINFORCE
    assert result.advantages_by_group[4].tolist() == [0.5, 0.0]
    assert (result.zero_variance_groups, result.solve_all_groups, result.solve_none_groups) == (2, 1, 1)
    assert result.nonfinite_rewards == 1
    metrics = result.metrics
    assert metrics["batch/solver/total"] == 3 and metrics["batch/solver/informative"] == 1
    assert metrics["batch/solver/solve_all"] == 1 and metrics["batch/solver/solve_none"] == 1
    assert metrics["batch/solver/fractions/too_easy"] == pytest.approx(1 / 3)
    assert metrics["reward/solver/mean"] == pytest.approx(0.5)
    assert metrics["advantage/solver/fraction_zero"] == pytest.approx(8 / 12)
    assert (
        metrics["reward/judge/max"] == 1.0 and "batch/judge/total" in metrics
    )  # the NaN group has one value
    assert metrics["batch/judge/total"] == 1


def test_advantages_feed_the_adapter_and_nan_rewards_are_dropped_there():
    groups = [make_group("t0", "solver", [1.0, 0.0, math.nan])]
    advantages = compute_group_advantages(groups, "grpo")
    config = BatchConfig(pad_token_id=0, drop_malformed=True)
    batch, stats = trajectory_groups_to_batch(groups, config, advantages.advantages_by_group)
    assert stats.dropped_malformed == 1 and batch.batch_size == 2
    assert batch["advantages"][:, -1].tolist() == pytest.approx([1.0, -1.0], abs=1e-5)


def gae_batch(dp_size: int):
    trajectories = [
        Trajectory([Step([1, 2], [3, 4]), Step([1, 2, 3, 4, 5], [6])], reward=1.0, uid="a"),
        Trajectory([Step([1], [7, 8, 9])], reward=-0.5, uid="b"),
        Trajectory([Step([4, 4, 4], [2])], reward=0.25, uid="c"),
    ]
    return trajectory_groups_to_batch(
        [group_of(*trajectories)], BatchConfig(pad_token_id=0, dp_size=dp_size)
    )[0]


@pytest.mark.parametrize("dp_size", [1, 4])
def test_gae_returns_are_the_outcome_when_undiscounted(dp_size):
    batch = gae_batch(dp_size)
    values_BT = torch.linspace(-1, 1, batch["rewards"].numel()).reshape(batch["rewards"].shape)
    add_gae_advantages(batch, values_BT, gamma=1.0, lambd=1.0)
    model_tokens = batch["loss_mask"] > 0
    expected_returns = torch.tensor([1.0, -0.5, 0.25])[:, None].expand(3, batch["rewards"].shape[1])
    torch.testing.assert_close(batch["returns"][:3][model_tokens[:3]], expected_returns[model_tokens[:3]])
    assert batch["advantages"][~model_tokens].abs().sum() == 0
    assert torch.equal(batch["values"], values_BT)


def test_gae_whitening_ignores_padding_rows():
    unpadded, padded = gae_batch(1), gae_batch(4)
    values_BT = torch.randn(padded["rewards"].shape, generator=torch.Generator().manual_seed(0))
    add_gae_advantages(unpadded, values_BT[:3].clone(), gamma=0.9, lambd=0.95)
    add_gae_advantages(padded, values_BT.clone(), gamma=0.9, lambd=0.95)
    torch.testing.assert_close(padded["advantages"][:3], unpadded["advantages"])
    # Same numbers as SkyRL's GAE called on the model tokens of the real rows.
    mask_BT = (unpadded["loss_mask"] > 0).float()
    skyrl, _ = compute_gae_advantage_return(
        unpadded["rewards"], values_BT[:3], mask_BT, gamma=0.9, lambd=0.95
    )
    torch.testing.assert_close(unpadded["advantages"], skyrl * mask_BT)


def test_gae_rejects_misshaped_values():
    batch = gae_batch(1)
    with pytest.raises(ValueError, match="values_BT has shape \\(3, 2\\); expected \\(3, 4\\)"):
        add_gae_advantages(batch, torch.zeros(3, 2))


def reduction_batch(dp_size: int = 1):
    """Two prompts: t0 has rows of 2 and 4 model tokens, t1 one row of 3; advantages 1, 2, 3."""
    groups = [
        group_of(Trajectory([Step([1], [2, 3])]), Trajectory([Step([1], [4, 5, 6, 7])]), task="t0"),
        group_of(Trajectory([Step([1, 1], [8, 9, 9])]), task="t1"),
    ]
    config = BatchConfig(pad_token_id=0, dp_size=dp_size)
    return trajectory_groups_to_batch(groups, config, [[1.0, 2.0], [3.0]])[0]


def summed_loss_weight(batch) -> float:
    """What SkyRL's summed surrogate reduces to at ratio 1: sum of advantage * loss_mask."""
    return (batch["advantages"] * batch["loss_mask"]).sum().item()


@pytest.mark.parametrize(
    ("reduction", "expected"),
    [
        ("token_mean", (2 * 1 + 4 * 2 + 3 * 3) / 9),
        ("sequence_mean", (1 + 2 + 3) / 3),
        ("seq_mean_token_mean", (1 + 2 + 3) / 3),
        ("seq-mean-token-mean", (1 + 2 + 3) / 3),
        ("seq_mean_token_sum", (2 * 1 + 4 * 2 + 3 * 3) / 3),
        ("prompt_mean", ((2 * 1 + 4 * 2) / 6 + 3) / 2),
    ],
)
@pytest.mark.parametrize("dp_size", [1, 4])
def test_loss_reduction_turns_the_sum_into_the_named_mean(reduction, expected, dp_size):
    batch = apply_loss_reduction(reduction_batch(dp_size), reduction)
    assert summed_loss_weight(batch) == pytest.approx(expected)
    assert batch["advantages"][3:].abs().sum() == 0  # padding rows
    assert batch.metadata["loss_reduction"] == reduction.replace("-", "_")


def test_dr_grpo_reduction_needs_its_constant():
    with pytest.raises(ValueError, match="pass max_seq_len"):
        apply_loss_reduction(reduction_batch(), "seq_mean_token_sum_norm")
    batch = apply_loss_reduction(reduction_batch(), "seq_mean_token_sum_norm", max_seq_len=10)
    assert summed_loss_weight(batch) == pytest.approx((2 * 1 + 4 * 2 + 3 * 3) / (3 * 10))


def test_each_mini_batch_is_reduced_on_its_own():
    batch = apply_loss_reduction(reduction_batch(), "token_mean", mini_batch_boundaries=[(0, 2), (2, 3)])
    first = (batch["advantages"][:2] * batch["loss_mask"][:2]).sum().item()
    second = (batch["advantages"][2:] * batch["loss_mask"][2:]).sum().item()
    assert first == pytest.approx((2 * 1 + 4 * 2) / 6) and second == pytest.approx(3.0)


def test_loss_reduction_guards():
    batch = apply_loss_reduction(reduction_batch(), "token_mean")
    with pytest.raises(ValueError, match="already scaled for 'token_mean'"):
        apply_loss_reduction(batch, "token_mean")
    with pytest.raises(ValueError, match="unknown loss_reduction 'mean'"):
        apply_loss_reduction(reduction_batch(), "mean")
    assert "seq_mean_token_sum" in LOSS_REDUCTIONS
    with pytest.raises(ValueError, match="pass the whole batch"):
        apply_loss_reduction(reduction_batch(dp_size=4)[0:2], "token_mean")
    with pytest.raises(ValueError, match="outside the 3 real rows"):
        apply_loss_reduction(reduction_batch(dp_size=4), "token_mean", mini_batch_boundaries=[(0, 4)])
    without_advantages = trajectory_groups_to_batch([group_of(Trajectory([Step([1], [2])]))], BatchConfig(0))[
        0
    ]
    with pytest.raises(ValueError, match="no advantages"):
        apply_loss_reduction(without_advantages, "token_mean")


def test_skyrl_ppo_loss_on_a_reduced_batch_is_the_token_mean_surrogate():
    """Adapter + reduction + resolved loss, through the loss function the policy worker calls."""
    batch = apply_loss_reduction(reduction_batch(dp_size=4), "token_mean")
    resolved = resolve_loss("policy", "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    base = AlgorithmConfig()
    config = type(base).from_dict_config(
        OmegaConf.merge(OmegaConf.create(asdict(base)), OmegaConf.create(resolved.skyrl_config))
    )
    loss, _ = ppo_policy_loss(
        batch["action_log_probs"],
        batch["action_log_probs"],
        batch["advantages"],
        config=config,
        loss_mask=batch["loss_mask"],
        rollout_logprobs=batch["rollout_logprobs"],
    )
    assert loss.item() == pytest.approx(-(2 * 1 + 4 * 2 + 3 * 3) / 9)


def test_zero_variance_reads_precomputed_advantages_of_every_kind():
    """Advantages already on the steps (rLLM's, or a workflow's own) may be a float, a list, a numpy
    array or a tensor per token; a group is flat only when every one is 0. One missing or unreadable
    keeps its group, so the data adapter's checks name it."""
    on_steps = BatchAdvantages(None, True, {})

    def group(*advantages):
        return group_of(*(Trajectory([Step([1, 2], [3, 4], advantage=a)]) for a in advantages))

    groups = [
        group(0.0, [0.0, 0.0]),
        group(np.zeros(2), torch.zeros(2)),
        group(np.array([0.0, 0.5]), 0.0),
        group(torch.tensor([0.0, -1.0]), [0.0, 0.0]),
        group(0.0, "high"),
        group(0.0, float("nan")),
        group(0.0, None),
    ]
    assert zero_variance(groups, on_steps) == [True, True, False, False, False, False, False]
