"""What a trajectory must satisfy to become a training row, checked field by field.

Every failure is a ``MalformedTrajectoryError`` naming the episode (or trajectory), the step and
the field, and saying what to fix; ``data_adapter`` raises it, or drops the trajectory and counts
it when ``drop_malformed`` is on. Inputs are read by attribute, so rLLM's pydantic types and
``rllm_skyrl.types`` both work.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import Any, Protocol


class RowRules(Protocol):
    """The parts of ``data_adapter.BatchConfig`` the checks read."""

    allowed_roles: Collection[str] | None
    vocab_size: int | None
    use_precomputed_advantages: bool


class MalformedTrajectoryError(ValueError):
    """A trajectory that cannot become a training row; names the item, the field and the fix."""

    def __init__(self, label: str, step_index: int | None, field_name: str, problem: str, remedy: str):
        where = label if step_index is None else f"{label} step {step_index}"
        super().__init__(f"{where}: {problem}; {remedy}")
        self.label = label
        self.step_index = step_index
        self.field_name = field_name


def group_role(group: Any) -> str:
    """The role a group trains (``"task:role"`` -> ``"role"``), as rLLM's ``group_role`` defines it."""
    role = getattr(group, "group_role", None)
    if role:
        return role
    return group.group_id.rpartition(":")[2] or "all_groups"


def trajectory_reward(trajectory: Any) -> float | None:
    """The outcome reward; rLLM falls back to the last step's reward when the trajectory has none."""
    if trajectory.reward is not None:
        return float(trajectory.reward)
    steps = trajectory.steps or []
    return float(steps[-1].reward) if steps and steps[-1].reward is not None else None


def trajectory_label(group: Any, traj_index: int) -> str:
    """A name a person can find in their logs: the episode id when the group carries it."""
    trajectory = group.trajectories[traj_index]
    metadata = list(getattr(group, "metadata", None) or [])
    meta = (
        metadata[traj_index] if traj_index < len(metadata) and isinstance(metadata[traj_index], dict) else {}
    )
    if meta.get("task_id") is not None and meta.get("rollout_idx") is not None:
        ident = f"episode '{meta['task_id']}:{meta['rollout_idx']}'"
    elif getattr(trajectory, "uid", None):
        ident = f"trajectory '{trajectory.uid}'"
    else:
        ident = f"trajectory #{traj_index} of group '{group.group_id}'"
    return f"{ident} (role '{getattr(trajectory, 'name', None)}')"


def token_ids(ids: Any) -> list[int]:
    return [int(t) for t in (ids if ids is not None else [])]


def check_tokens(label: str, index: int | None, name: str, ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise MalformedTrajectoryError(
            label,
            index,
            name,
            f"token id {bad} is outside the vocabulary [0, {vocab_size})",
            "the sampler returned an id the trainer's model cannot embed; check that both use the same model",
        )


def _step_logprobs(label: str, index: int, step: Any, n_response: int) -> list[float]:
    logprobs = [float(x) for x in (step.logprobs if step.logprobs is not None else [])]
    if len(logprobs) != n_response:
        raise MalformedTrajectoryError(
            label,
            index,
            "logprobs",
            f"{len(logprobs)} logprobs for {n_response} response tokens",
            "the rollout engine must return one logprob per sampled token",
        )
    if not all(math.isfinite(x) for x in logprobs):
        raise MalformedTrajectoryError(
            label,
            index,
            "logprobs",
            "logprobs contain NaN or inf",
            "the rollout engine returned a broken logprob",
        )
    return logprobs


def _step_advantages(label: str, index: int, step: Any, n_response: int, scalar: float | None) -> list[float]:
    """Per-token advantages of one step: the trajectory's scalar, or the step's own (precomputed)."""
    value = scalar if scalar is not None else step.advantage
    if value is None:
        raise MalformedTrajectoryError(
            label,
            index,
            "advantage",
            "step.advantage is None",
            "with use_precomputed_advantages every step needs a float or one value per response token",
        )
    values = [float(value)] * n_response if isinstance(value, numbers.Real) else [float(v) for v in value]
    if len(values) != n_response:
        raise MalformedTrajectoryError(
            label,
            index,
            "advantage",
            f"{len(values)} advantages for {n_response} response tokens",
            "a per-token step.advantage must have one value per response token",
        )
    if not all(math.isfinite(v) for v in values):
        raise MalformedTrajectoryError(
            label, index, "advantage", "advantage is NaN or inf", "check the advantage estimator's inputs"
        )
    return values


def check_trajectory(trajectory: Any, label: str, config: RowRules, advantage: float | None) -> None:
    """Trajectory-level checks: role, steps, outcome reward, scalar advantage."""
    role = getattr(trajectory, "name", None)
    if config.allowed_roles is not None and role not in config.allowed_roles:
        raise MalformedTrajectoryError(
            label,
            None,
            "name",
            f"unknown role {role!r} (configured roles: {sorted(config.allowed_roles)})",
            "name the trajectory after a configured role, or add its role to the config",
        )
    if not trajectory.steps:
        raise MalformedTrajectoryError(label, None, "steps", "no steps", "a trajectory needs a model call")
    reward = trajectory_reward(trajectory)
    if reward is None and not config.use_precomputed_advantages:
        raise MalformedTrajectoryError(
            label, None, "reward", "reward is None", "set Trajectory.reward (or the last step's reward)"
        )
    if reward is not None and not math.isfinite(reward):
        raise MalformedTrajectoryError(
            label, None, "reward", f"reward is {reward}", "the reward function must return a finite number"
        )
    if advantage is not None and not math.isfinite(advantage):
        raise MalformedTrajectoryError(
            label, None, "advantage", f"advantage is {advantage}", "check the advantage estimator's inputs"
        )


def step_fields(
    label: str, index: int, step: Any, config: RowRules, advantage: float | None, needs_advantages: bool
) -> tuple[list[int], list[int], list[float], list[float]]:
    """One step's checked ``(prompt_ids, response_ids, logprobs, advantages)``."""
    prompt_ids, response_ids = token_ids(step.prompt_ids), token_ids(step.response_ids)
    if not response_ids:
        raise MalformedTrajectoryError(
            label, index, "response_ids", "empty response", "drop steps where the model produced no tokens"
        )
    check_tokens(label, index, "prompt_ids", prompt_ids, config.vocab_size)
    check_tokens(label, index, "response_ids", response_ids, config.vocab_size)
    logprobs = _step_logprobs(label, index, step, len(response_ids))
    if not needs_advantages:
        return prompt_ids, response_ids, logprobs, [0.0] * len(response_ids)
    return (
        prompt_ids,
        response_ids,
        logprobs,
        _step_advantages(label, index, step, len(response_ids), advantage),
    )
