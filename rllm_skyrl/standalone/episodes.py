"""What the driver derives from episodes: trajectory groups and the reward/batch/val metrics.

Pure functions over the records in ``types.py``; no backend, no I/O.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from rllm_skyrl.records import (
    Episode,
    TerminationReason,
    Trajectory,
    TrajectoryGroup,
    termination_value,
)
from rllm_skyrl.standalone.config import CompactFilteringConfig, TransformConfig

logger = logging.getLogger(__name__)


def group_trajectories(
    episodes: Sequence[Episode], transform: TransformConfig, compact_filtering: CompactFilteringConfig
) -> tuple[list[TrajectoryGroup], dict[str, float]]:
    """Group trajectories by ``"{task_id}:{role}"`` across the rollouts of each task.

    Episodes masked by compact filtering and trajectories without steps are left out;
    unnamed trajectories are named by position (rLLM's imputation); a trajectory without a
    reward takes its last step's; a non-finite reward drops the trajectory with a warning and a
    count in ``groups/dropped_nonfinite_reward`` rather than poisoning the update.
    """
    trajectories: dict[str, list[Trajectory]] = defaultdict(list)
    metadata: dict[str, list[dict]] = defaultdict(list)
    masked = dropped_nonfinite = 0
    for episode in episodes:
        if compact_filtering.should_mask(episode.termination_reason):
            masked += 1
            continue
        for position, trajectory in enumerate(episode.trajectories):
            if not trajectory.steps:
                continue
            if trajectory.name in ("", transform.default_traj_name):
                if transform.impute_missing_names:
                    trajectory.name = f"{transform.default_traj_name}_{position}"
                elif transform.drop_unnamed_traj:
                    continue
            if trajectory.reward is None:
                trajectory.reward = trajectory.steps[-1].reward
            if not math.isfinite(trajectory.reward):
                logger.warning(
                    "episode %r trajectory %r has reward %r; dropped from training",
                    episode.id,
                    trajectory.name,
                    trajectory.reward,
                )
                dropped_nonfinite += 1
                continue
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
    metrics = {
        "groups/num_groups": float(len(groups)),
        "groups/num_trajs": float(sum(len(g.trajectories) for g in groups)),
        "groups/masked_episodes": float(masked),
        "groups/dropped_nonfinite_reward": float(dropped_nonfinite),
    }
    return groups, metrics


def _summary(prefix: str, values: Sequence[float]) -> dict[str, float]:
    values_N = np.asarray(values, dtype=float)
    return {
        f"{prefix}/mean": float(values_N.mean()),
        f"{prefix}/std": float(values_N.std()),
        f"{prefix}/max": float(values_N.max()),
        f"{prefix}/min": float(values_N.min()),
    }


def reward_metrics(groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """``reward/<role>/{mean,std,max,min}`` per role and ``reward/{...}`` over all trajectories."""
    by_role: dict[str, list[float]] = defaultdict(list)
    for group in groups:
        by_role[group.group_role].extend(t.reward for t in group.trajectories)
    metrics: dict[str, float] = {}
    for role, rewards in sorted(by_role.items()):
        metrics.update(_summary(f"reward/{role}", rewards))
    all_rewards = [r for rewards in by_role.values() for r in rewards]
    if all_rewards:
        metrics.update(_summary("reward", all_rewards))
    return metrics


def _mean_numeric_metrics(episodes: Iterable[Episode]) -> dict[str, float]:
    """Mean of each numeric ``Episode.metrics`` entry; non-numeric values are skipped, as rLLM does."""
    values: dict[str, list[float]] = defaultdict(list)
    for episode in episodes:
        for key, value in episode.metrics.items():
            if isinstance(value, int | float | np.number) and not isinstance(value, bool):
                values[key].append(float(value))
    return {key: float(np.mean(v)) for key, v in values.items()}


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """``batch/<workflow metric>`` means and ``batch/termination_reason/<reason>`` fractions."""
    metrics = {f"batch/{key}": value for key, value in _mean_numeric_metrics(episodes).items()}
    total = max(len(episodes), 1)
    for reason in TerminationReason:
        count = sum(termination_value(e.termination_reason) == reason.value for e in episodes)
        metrics[f"batch/termination_reason/{reason.value}"] = count / total
    metrics["batch/num_episodes"] = float(len(episodes))
    return metrics


def data_source(episode: Episode) -> str:
    """Where a validation episode's task came from: episode metadata, else the task row, else unknown."""
    if "data_source" in episode.metadata:
        return str(episode.metadata["data_source"])
    if isinstance(episode.task, dict) and "data_source" in episode.task:
        return str(episode.task["data_source"])
    return "unknown"


def validation_metrics(episodes: Sequence[Episode], n_val: int) -> dict[str, float]:
    """Per data source: ``pass@1`` (mean correctness over all rollouts), ``pass@<n_val>`` (share of
    tasks with at least one correct rollout) and the mean of each workflow metric."""
    by_source: dict[str, list[Episode]] = defaultdict(list)
    for episode in episodes:
        by_source[data_source(episode)].append(episode)
    metrics: dict[str, float] = {}
    for source, source_episodes in sorted(by_source.items()):
        solved_by_task: dict[str, bool] = defaultdict(bool)
        for episode in source_episodes:
            solved_by_task[episode.task_id] |= bool(episode.is_correct)
        metrics[f"val/{source}/pass@1"] = float(np.mean([bool(e.is_correct) for e in source_episodes]))
        metrics[f"val/{source}/pass@{n_val}"] = float(np.mean(list(solved_by_task.values())))
        for key, value in _mean_numeric_metrics(source_episodes).items():
            metrics[f"val/{source}/{key}"] = value
    return metrics
