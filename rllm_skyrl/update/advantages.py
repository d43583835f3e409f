"""Advantages: rLLM's outcome estimators, SkyRL's GAE, and SkyRL's loss-reduction pre-scaling.

Under rLLM's trainer, rLLM's own estimators compute outcome advantages (``batch_advantages``); the
ones here serve the standalone trainer and are tested equal to rLLM's ``rllm/trainer/algorithms``,
so a run means the same thing on every rLLM backend. SkyRL's registered estimators
(``ppo_utils.compute_grpo_outcome_advantage`` and friends) differ from rLLM where it matters:

- GRPO: SkyRL normalises by the unbiased group std, rLLM by the population std;
- RLOO: a group of one gets advantage 0 in SkyRL, its reward in rLLM;
- REINFORCE and REINFORCE++-baseline (group mean, role-level std) have no SkyRL counterpart
  (SkyRL's ``reinforce++`` whitens discounted token returns over the batch).

GAE needs per-token critic values, so it is SkyRL's own ``compute_gae_advantage_return``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.utils.ppo_utils import (
    apply_loss_reduction_to_advantages_minibatch,
    compute_gae_advantage_return,
)

from rllm_skyrl import rllm_api
from rllm_skyrl.data.batch_layout import real_rows
from rllm_skyrl.data.trajectory_checks import group_role, trajectory_reward
from rllm_skyrl.run_config.algorithm import OUTCOME_ESTIMATORS as ESTIMATORS
from rllm_skyrl.run_config.algorithm import SKYRL_LOSS_REDUCTIONS

# A group whose rewards spread less than this carries no learning signal (rLLM's tolerance).
ZERO_VARIANCE_STD = 1e-8

LOSS_REDUCTIONS = tuple(SKYRL_LOSS_REDUCTIONS)


def outcome_advantages(
    rewards_by_group: Sequence[torch.Tensor],
    estimator: str,
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> list[torch.Tensor]:
    """One advantage per trajectory for groups of one role; ``rewards_by_group[g]`` is ``rewards_G``.

    Non-finite rewards are left out of every baseline and get advantage 0; the data adapter then
    rejects (or drops and counts) those trajectories, so they never reach a loss.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {list(ESTIMATORS)}")
    sizes = [len(r) for r in rewards_by_group]
    if sum(sizes) == 0:
        return [torch.zeros(0, dtype=torch.float64) for _ in sizes]
    rewards_N = torch.cat([torch.as_tensor(r, dtype=torch.float64).reshape(-1) for r in rewards_by_group])
    group_N = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    finite_N = torch.isfinite(rewards_N)
    rewards_N = torch.where(finite_N, rewards_N, 0.0)

    def group_sum(values_N: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(sizes), dtype=torch.float64).index_add_(0, group_N, values_N)

    count_G = group_sum(finite_N.double())
    mean_G = group_sum(rewards_N) / count_G.clamp(min=1)
    centered_N = torch.where(finite_N, rewards_N - mean_G[group_N], 0.0)
    single_N = count_G[group_N] <= 1
    if estimator == "reinforce":
        advantages_N = rewards_N
    elif estimator == "grpo":
        # rLLM: population std; a group of one keeps baseline 0 and scale 1.
        std_G = (group_sum(centered_N**2) / count_G.clamp(min=1)).sqrt()
        scale_N = std_G[group_N] + epsilon if norm_by_std else torch.ones_like(rewards_N)
        single_scale = 1.0 + epsilon if norm_by_std else 1.0
        advantages_N = torch.where(single_N, rewards_N / single_scale, centered_N / scale_N)
    elif estimator == "rloo":
        # Leave-one-out mean as baseline: n/(n-1) * (r - mean). rLLM keeps the raw reward for n=1.
        factor_N = count_G[group_N] / (count_G[group_N] - 1).clamp(min=1)
        advantages_N = torch.where(single_N, rewards_N, factor_N * centered_N)
    else:  # std pooled over the whole role; baseline: the role's mean (prpo) or the group's
        if estimator == "prpo":
            centered_N = rewards_N - (rewards_N[finite_N].mean() if finite_N.any() else 0.0)
        role_std = centered_N[finite_N].std(unbiased=False) if finite_N.any() else 0.0
        advantages_N = centered_N / (role_std + epsilon)
    advantages_N = torch.where(finite_N, advantages_N, 0.0)
    return list(torch.split(advantages_N, sizes))


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages aligned with the input groups, plus what the reward spread says about them.

    A zero-variance group (two or more trajectories) counts as ``solve_all`` when its reward is
    >= 1 and ``solve_none`` when <= 0, following rLLM's too_easy / too_hard split.
    """

    advantages_by_group: list[torch.Tensor]
    zero_variance_groups: int
    solve_all_groups: int
    solve_none_groups: int
    nonfinite_rewards: int
    metrics: dict[str, float]


def _group_rewards(group: Any) -> torch.Tensor:
    """A group without a usable trajectory list has none (the data adapter drops it and says why)."""
    trajectories = group.trajectories if isinstance(group.trajectories, list | tuple) else []
    rewards = [trajectory_reward(t) for t in trajectories]
    return torch.tensor([float("nan") if r is None else r for r in rewards], dtype=torch.float64)


def _summary(prefix: str, values_N: torch.Tensor) -> dict[str, float]:
    if values_N.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": values_N.mean().item(),
        f"{prefix}/std": values_N.std(unbiased=False).item(),
        f"{prefix}/max": values_N.max().item(),
        f"{prefix}/min": values_N.min().item(),
    }


@dataclass(frozen=True)
class _Spread:
    groups: int = 0  # groups with two or more finite rewards
    zero_variance: int = 0
    solve_all: int = 0
    solve_none: int = 0

    def metrics(self, role: str) -> dict[str, float]:
        if not self.groups:
            return {}
        informative = self.groups - self.zero_variance
        return {
            f"batch/{role}/total": float(self.groups),
            f"batch/{role}/informative": float(informative),
            f"batch/{role}/solve_all": float(self.solve_all),
            f"batch/{role}/solve_none": float(self.solve_none),
            f"batch/{role}/fractions/effective": informative / self.groups,
            f"batch/{role}/fractions/too_easy": self.solve_all / self.groups,
            f"batch/{role}/fractions/too_hard": self.solve_none / self.groups,
        }


def _spread(rewards_by_group: Sequence[torch.Tensor]) -> _Spread:
    groups = zero = solve_all = solve_none = 0
    for rewards_G in rewards_by_group:
        finite_G = rewards_G[torch.isfinite(rewards_G)]
        if finite_G.numel() < 2:
            continue
        groups += 1
        if finite_G.std(unbiased=False).item() >= ZERO_VARIANCE_STD:
            continue
        zero += 1
        mean = finite_G.mean().item()
        solve_all += int(mean >= 1.0)
        solve_none += int(mean <= 0.0)
    return _Spread(groups, zero, solve_all, solve_none)


def compute_group_advantages(
    groups: Sequence[Any],
    estimator: str = "grpo",
    *,
    estimator_map: Mapping[str, str] | None = None,
    norm_by_std: bool = True,
) -> GroupAdvantages:
    """rLLM-style advantages, one estimator per role (``estimator_map``), with rLLM's metric names."""
    rewards_by_group = [_group_rewards(g) for g in groups]
    indices_by_role: dict[str, list[int]] = defaultdict(list)
    for i, group in enumerate(groups):
        indices_by_role[group_role(group)].append(i)
    advantages_by_group: list[torch.Tensor] = [torch.zeros(0)] * len(groups)
    metrics: dict[str, float] = {}
    spreads: list[_Spread] = []
    for role, indices in indices_by_role.items():
        role_rewards = [rewards_by_group[i] for i in indices]
        role_estimator = (estimator_map or {}).get(role, estimator)
        role_advantages = outcome_advantages(role_rewards, role_estimator, norm_by_std=norm_by_std)
        for i, advantages_G in zip(indices, role_advantages, strict=True):
            advantages_by_group[i] = advantages_G
        rewards_N = torch.cat(role_rewards)
        finite_N = torch.isfinite(rewards_N)
        advantages_N = torch.cat(role_advantages)[finite_N]
        metrics |= _summary(f"reward/{role}", rewards_N[finite_N])
        metrics |= _summary(f"advantage/{role}", advantages_N)
        if advantages_N.numel():
            metrics[f"advantage/{role}/fraction_zero"] = (advantages_N.abs() < 1e-8).double().mean().item()
        spreads.append(_spread(role_rewards))
        metrics |= spreads[-1].metrics(role)
    all_rewards_N = torch.cat(rewards_by_group) if rewards_by_group else torch.zeros(0)
    return GroupAdvantages(
        advantages_by_group=advantages_by_group,
        zero_variance_groups=sum(s.zero_variance for s in spreads),
        solve_all_groups=sum(s.solve_all for s in spreads),
        solve_none_groups=sum(s.solve_none for s in spreads),
        nonfinite_rewards=int((~torch.isfinite(all_rewards_N)).sum()),
        metrics=metrics,
    )


@dataclass(frozen=True)
class BatchAdvantages:
    """What the data adapter needs: per-trajectory scalars, or ``on_steps`` (read ``step.advantage``)."""

    by_group: list[list[float]] | None
    on_steps: bool
    metrics: dict[str, float]


def batch_advantages(groups: Sequence[Any], run: Any, algorithm_config: Any = None) -> BatchAdvantages:
    """Outcome advantages for one step's groups, computed by whoever owns them: none yet under GAE
    (they need the critic's forward), already on the steps in rLLM's fully-async mode and with
    ``use_precomputed_advantage``, rLLM's registry under rLLM's ``AlgorithmConfig``, else this module's.
    """
    rewards = reward_metrics(groups)
    if run.uses_critic:
        return BatchAdvantages(None, False, rewards)
    if run.use_precomputed_advantage:
        return BatchAdvantages(None, True, {**distill_metrics(groups), **rewards})
    if run.async_training:
        return BatchAdvantages(None, True, rewards)
    if rllm_api.is_rllm_algorithm_config(algorithm_config):
        return BatchAdvantages(None, True, {**rllm_api.rllm_advantages(groups, algorithm_config), **rewards})
    outcome = compute_group_advantages(
        groups, run.estimator, estimator_map=run.estimator_map, norm_by_std=run.norm_adv_by_std
    )
    by_group = [a.tolist() for a in outcome.advantages_by_group]
    return BatchAdvantages(by_group, False, {**outcome.metrics, **rewards})


def distill_metrics(groups: Sequence[Any]) -> dict[str, float]:
    """``distill/reverse_kl``: the sampled estimate of KL(student || teacher), the mean over response
    tokens of ``student_lp - teacher_lp``. rLLM's distillation workflows set each token's precomputed
    advantage to ``teacher_lp - student_lp`` (clipped to their ``clip_min``/``clip_max`` when set:
    the estimate is then of the clipped terms), so it is minus the mean of the per-token advantages;
    steps with one scalar advantage (not a distillation's) are left out."""
    per_token = [
        np.asarray(step.advantage, dtype=np.float64)
        for group in groups
        for trajectory in group.trajectories
        for step in trajectory.steps or []
        if isinstance(step.advantage, list | tuple | np.ndarray | torch.Tensor)
    ]
    tokens = np.concatenate(per_token) if per_token else np.zeros(0)
    if not tokens.size:
        return {}
    return {"distill/reverse_kl": float(-tokens.mean()), "distill/tokens": float(tokens.size)}


def reward_metrics(groups: Sequence[Any]) -> dict[str, float]:
    """``reward/<role>/*`` and, over every role, ``reward/mean`` and ``reward/std``."""
    by_role: dict[str, list[torch.Tensor]] = defaultdict(list)
    for group in groups:
        rewards_G = _group_rewards(group)
        by_role[group_role(group)].append(rewards_G[torch.isfinite(rewards_G)])
    metrics: dict[str, float] = {}
    for role, rewards in by_role.items():
        metrics |= _summary(f"reward/{role}", torch.cat(rewards))
    finite_N = torch.cat([r for rewards in by_role.values() for r in rewards] or [torch.zeros(0)])
    if finite_N.numel():
        metrics["reward/mean"] = finite_N.mean().item()
        metrics["reward/std"] = finite_N.std(unbiased=False).item()
    return metrics


def zero_variance(groups: Sequence[Any], advantages: BatchAdvantages) -> list[bool]:
    """Per group: whether every advantage is 0 (the group would push the policy nowhere)."""
    if advantages.by_group is not None:
        return [all(abs(a) < ZERO_VARIANCE_STD for a in group) for group in advantages.by_group]
    return [
        all(_all_zero(step.advantage) for trajectory in group.trajectories for step in trajectory.steps or [])
        for group in groups
    ]


def _all_zero(advantage: Any) -> bool:
    """A step's own advantage (a float, or one per token as a list, array or tensor) is all 0; a
    missing one or one that is not a number keeps its group, for the data adapter to reject by name."""
    try:
        values = np.asarray(advantage, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return bool(np.all(np.abs(values) < ZERO_VARIANCE_STD))


def _real_rows(batch: TrainingInputBatch) -> int:
    """``real_rows``, refusing a slice whose metadata describes its parent batch."""
    row_ids = batch.metadata.get("row_ids")
    if row_ids is not None and len(row_ids) != batch.batch_size:
        raise ValueError(
            f"batch has {batch.batch_size} rows but its metadata describes {len(row_ids)}; "
            "pass the whole batch (with mini_batch_boundaries) rather than a slice of it"
        )
    return real_rows(batch)


def add_gae_advantages(
    batch: TrainingInputBatch, values_BT: torch.Tensor, *, gamma: float = 1.0, lambd: float = 1.0
) -> TrainingInputBatch:
    """Fill ``advantages``, ``returns`` and ``values`` from the critic's values with SkyRL's GAE.

    Whitening uses model tokens of real rows only, so observation tokens and DP padding do not
    shift it. Observation tokens stay in the TD chain: the critic values every position of the
    row, as SkyRL's token-level MDP does.
    """
    rewards_BT = batch["rewards"]
    if values_BT.shape != rewards_BT.shape:
        raise ValueError(f"values_BT has shape {tuple(values_BT.shape)}; expected {tuple(rewards_BT.shape)}")
    mask_BT = (batch["loss_mask"] > 0).float()
    mask_BT[_real_rows(batch) :] = 0.0
    values_BT = values_BT.to(rewards_BT.dtype)
    advantages_BT, returns_BT = compute_gae_advantage_return(
        token_level_rewards=rewards_BT, values=values_BT, response_mask=mask_BT, gamma=gamma, lambd=lambd
    )
    batch["advantages"] = advantages_BT * mask_BT
    batch["returns"] = returns_BT
    batch["values"] = values_BT
    return batch


def apply_loss_reduction(
    batch: TrainingInputBatch,
    loss_reduction: str,
    *,
    mini_batch_boundaries: Sequence[tuple[int, int]] | None = None,
    max_seq_len: int | None = None,
    scale: float = 1.0,
) -> TrainingInputBatch:
    """Scale ``advantages`` so SkyRL's summed policy loss becomes the requested mean.

    SkyRL's policy losses return masked sums (``ppo_utils.reduce_loss``) and the worker
    multiplies by the DP size to undo gradient averaging. SkyRL's own trainer turns the sum into
    ``token_mean`` etc. by pre-scaling advantages per mini-batch
    (``RayPPOTrainer._normalize_advantages`` -> ``apply_loss_reduction_to_advantages_minibatch``).
    A direct ``WorkerDispatch.forward_backward`` call skips that trainer code, so call this once on
    the rows of each optimizer step before dispatching them (a second call raises).

    ``mini_batch_boundaries``: ``(start, end)`` row ranges, one per optimizer step (default: all
    real rows). DP padding rows get advantage 0 and never count as sequences. ``scale``: the share
    of an optimizer step these rows are, when its gradients accumulate over several calls
    (rLLM's fully-async chunks).
    """
    key = loss_reduction.replace("-", "_")
    if key not in SKYRL_LOSS_REDUCTIONS:
        raise ValueError(f"unknown loss_reduction {loss_reduction!r}; choose one of {list(LOSS_REDUCTIONS)}")
    if "loss_reduction" in batch.metadata:
        raise ValueError(
            f"advantages were already scaled for {batch.metadata['loss_reduction']!r}; scaling twice would "
            "shrink the update, build a fresh batch instead"
        )
    if batch.get("advantages") is None:
        raise ValueError("batch has no advantages to scale; compute them before applying the loss reduction")
    skyrl_reduction, fixed_len = SKYRL_LOSS_REDUCTIONS[key]
    seq_len = fixed_len or max_seq_len
    if skyrl_reduction == "seq_mean_token_sum_norm" and seq_len is None:
        raise ValueError("seq_mean_token_sum_norm divides by a constant length: pass max_seq_len")
    num_real = _real_rows(batch)
    boundaries = list(mini_batch_boundaries or [(0, num_real)])
    for start, end in boundaries:
        if not 0 <= start < end <= num_real:
            raise ValueError(f"mini-batch ({start}, {end}) is outside the {num_real} real rows")
    uids = batch.metadata.get("uids")
    if skyrl_reduction == "prompt_mean" and uids is None:
        raise ValueError("prompt_mean needs metadata['uids'] (the group of each row)")
    if skyrl_reduction == "prompt_mean":  # its module imports datasets and pandas
        from skyrl.train.dataset.preprocess import compute_prompt_boundaries
    advantages_BT = batch["advantages"]
    scaled_BT = torch.zeros_like(advantages_BT)
    for start, end in boundaries:
        prompt_boundaries = (
            compute_prompt_boundaries(uids[start:end]) if skyrl_reduction == "prompt_mean" else None
        )
        scaled_BT[start:end] = apply_loss_reduction_to_advantages_minibatch(
            advantages=advantages_BT[start:end],
            loss_mask=batch["loss_mask"][start:end],
            loss_reduction=skyrl_reduction,
            micro_batch_size=1,
            max_seq_len=seq_len,
            prompt_boundaries=prompt_boundaries,
        )
    batch["advantages"] = scaled_BT * scale if scale != 1.0 else scaled_BT
    # A fresh dict: slices taken earlier share the old metadata and must not look scaled.
    batch.metadata = {**batch.metadata, "loss_reduction": key}
    return batch
