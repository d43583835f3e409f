"""What the fallback trainer derives from episodes: trajectory groups and the batch/val metrics.

The contract is rLLM's (``rllm/trainer/algorithms/transform.py``, ``rejection_sampling.py``) with
its default settings: an unnamed trajectory takes the name ``default_traj_name_<position>``, a
trajectory without a reward takes its last step's, trajectories group by ``"{task_id}:{name}"``,
and a group of fewer than two trajectories (nothing to compare with) is not trained on.
Rewards are the backend's to check (a NaN fails or is dropped there, as under rLLM).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from rllm_skyrl.records import DEFAULT_TRAJECTORY_NAME, TerminationReason, TrajectoryGroup, termination_value

MIN_TRAJECTORIES_PER_GROUP = 2


def group_trajectories(episodes: Sequence[Any]) -> tuple[list[TrajectoryGroup], dict[str, float]]:
    trajectories: dict[str, list[Any]] = defaultdict(list)
    metadata: dict[str, list[dict]] = defaultdict(list)
    for episode in episodes:
        for position, trajectory in enumerate(episode.trajectories):
            if trajectory.name in ("", DEFAULT_TRAJECTORY_NAME):
                trajectory.name = f"{DEFAULT_TRAJECTORY_NAME}_{position}"
            if not trajectory.steps:
                continue
            if trajectory.reward is None:
                trajectory.reward = trajectory.steps[-1].reward
            group_id = f"{episode.task_id}:{trajectory.name}"
            trajectories[group_id].append(trajectory)
            metadata[group_id].append(
                {
                    "task_id": episode.task_id,
                    "rollout_idx": episode.rollout_idx,
                    "termination_reason": episode.termination_reason,
                    "is_correct": episode.is_correct,
                }
            )
    groups = [
        TrajectoryGroup(trajs, group_id=gid, metadata=metadata[gid]) for gid, trajs in trajectories.items()
    ]
    kept = [group for group in groups if len(group.trajectories) >= MIN_TRAJECTORIES_PER_GROUP]
    metrics = {
        "groups/num_groups": float(len(kept)),
        "groups/num_trajs": float(sum(len(group.trajectories) for group in kept)),
        "batch/groups_dropped_insufficient_trajs": float(len(groups) - len(kept)),
    }
    return kept, metrics


def _numeric_means(episodes: Sequence[Any]) -> dict[str, float]:
    """Mean of each numeric ``Episode.metrics`` entry; others are skipped, as rLLM does."""
    values: dict[str, list[float]] = defaultdict(list)
    for episode in episodes:
        for key, value in episode.metrics.items():
            if isinstance(value, int | float | np.number) and not isinstance(value, bool):
                values[key].append(float(value))
    return {key: float(np.mean(v)) for key, v in values.items()}


def episode_metrics(episodes: Sequence[Any]) -> dict[str, float]:
    """``batch/<workflow metric>`` means and ``batch/termination_reason/<reason>`` fractions."""
    metrics = {f"batch/{key}": value for key, value in _numeric_means(episodes).items()}
    reasons = [termination_value(episode.termination_reason) for episode in episodes]
    total = max(len(reasons), 1)
    for reason in TerminationReason:
        metrics[f"batch/termination_reason/{reason.value}"] = reasons.count(reason.value) / total
    return metrics


def validation_metrics(episodes: Sequence[Any], n_val: int) -> dict[str, float]:
    """Per data source: ``pass@1`` (mean correctness of all rollouts), ``pass@<n_val>`` (share of tasks
    with a correct rollout) and the mean of each workflow metric."""
    by_source: dict[str, list[Any]] = defaultdict(list)
    for episode in episodes:
        by_source[str(episode.metadata.get("data_source", "unknown"))].append(episode)
    metrics: dict[str, float] = {}
    for source, source_episodes in sorted(by_source.items()):
        solved: dict[str, bool] = defaultdict(bool)
        for episode in source_episodes:
            solved[episode.task_id] |= bool(episode.is_correct)
        metrics[f"val/{source}/pass@1"] = float(np.mean([bool(e.is_correct) for e in source_episodes]))
        metrics[f"val/{source}/pass@{n_val}"] = float(np.mean(list(solved.values())))
        metrics |= {f"val/{source}/{key}": value for key, value in _numeric_means(source_episodes).items()}
    return metrics
