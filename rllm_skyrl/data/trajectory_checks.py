"""What a trajectory must satisfy to become a training row, checked field by field.

Every failure is a ``MalformedTrajectoryError`` naming the episode (or trajectory), the step, the
field and the fix; ``data.adapter`` raises it, or with ``drop_malformed`` drops and counts the
trajectory. Fields are read by attribute (rLLM's pydantic types and ``rllm_skyrl.records`` both
work) and never coerced: a value reaches the tensors as itself (ids as int64, reals rounded to
float32 as SkyRL's own builder does) or the trajectory is rejected. Accepted, of what is read:

* integers: what ``operator.index`` accepts (``int``, numpy integer scalars, 0-d integer arrays),
  never ``bool`` / ``numpy.bool_``; no floats (not even ``3.0``), no strings.
* reals: what ``float()`` accepts without parsing text (``float``, ``int``, numpy and torch scalars,
  ``Decimal``, ``Fraction``), never bools, ``str`` or ``bytes``; finite and within float32's range.
* id and value lists: a ``list`` or ``tuple`` of such numbers, or a 1-D numpy array of an integer
  (ids) or integer/float (values) dtype; not ``None``, strings, sets, tensors or nested lists.
* token ids: ``0 <= id < vocab_size`` (``< 2**63`` when the vocabulary size is unknown).
* ``step.logprobs``: one per response token, finite and ``<= LOGPROB_TOLERANCE``.
* ``step.metadata``: absent, ``None`` or a mapping; its ``lineage_id`` absent, ``None``, a ``str``
  or an integer.
* ``trajectory.reward``: ``None`` (then the last step's ``reward``) or a finite real.
* ``trajectory.steps``: a non-empty list or tuple; ``group.trajectories``: a list or tuple;
  ``group.group_id``: a non-empty ``str`` (SkyRL's uid); ``trajectory.name``: a configured role when
  roles are configured. ``group.metadata`` and ``trajectory.uid`` only name things in messages.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from numbers import Integral
from typing import Any, Protocol

from rllm_skyrl.data.value_checks import MalformedTrajectoryError, is_bool, real_scalar, show

# A sampled token's logprob is log p <= 0. Inference engines compute it as logit - logsumexp in
# float32, where rounding can leave a value a few ulps above 0; 1e-4 covers float32 rounding at
# any realistic logit scale (ulp(1000) = 6e-5) and is far too small to move an importance ratio
# (exp(1e-4) - 1 = 0.01%). Accepted values are passed through unchanged, not clipped.
LOGPROB_TOLERANCE = 1e-4


class RowRules(Protocol):
    """The parts of ``data.adapter.BatchConfig`` the checks read."""

    allowed_roles: Collection[str] | None
    vocab_size: int | None
    max_seq_len: int | None
    use_precomputed_advantages: bool


def group_role(group: Any) -> str:
    """The role a group trains (``"task:role"`` -> ``"role"``), as rLLM's ``group_role``. Never raises:
    a group without a usable id counts as ``"all_groups"`` (``check_group_id`` rejects it later)."""
    role = getattr(group, "group_role", None)
    if isinstance(role, str) and role:
        return role
    group_id = getattr(group, "group_id", None)
    return (group_id.rpartition(":")[2] if isinstance(group_id, str) else "") or "all_groups"


def trajectory_label(group: Any, traj_index: int) -> str:
    """A name a person can find in their logs: the episode id when the group carries it. Never raises."""
    trajectories = getattr(group, "trajectories", None)
    trajectory = trajectories[traj_index] if isinstance(trajectories, list | tuple) else None
    metadata = getattr(group, "metadata", None)
    meta = metadata[traj_index] if isinstance(metadata, list | tuple) and traj_index < len(metadata) else None
    meta = meta if isinstance(meta, Mapping) else {}
    uid = getattr(trajectory, "uid", None)
    if meta.get("task_id") is not None and meta.get("rollout_idx") is not None:
        ident = f"episode '{meta['task_id']}:{meta['rollout_idx']}'"
    elif isinstance(uid, str) and uid:
        ident = f"trajectory '{uid}'"
    else:
        ident = f"trajectory #{traj_index} of group {show(getattr(group, 'group_id', None))}"
    return f"{ident} (role {show(getattr(trajectory, 'name', None))})"


def group_label(group: Any, group_index: int) -> str:
    return f"group #{group_index} {show(getattr(group, 'group_id', None))}"


def _outcome_reward_source(trajectory: Any) -> Any:
    """The raw outcome reward: ``trajectory.reward``, else the last step's (rLLM's fallback)."""
    reward = getattr(trajectory, "reward", None)
    if reward is not None:
        return reward
    steps = getattr(trajectory, "steps", None)
    return getattr(steps[-1], "reward", None) if isinstance(steps, list | tuple) and steps else None


def reward_given(trajectory: Any) -> bool:
    """Whether the trajectory (or its last step) carries a reward at all, well-formed or not."""
    return _outcome_reward_source(trajectory) is not None


def trajectory_reward(trajectory: Any) -> float | None:
    """The outcome reward for statistics and estimators, or ``None``; never raises. A malformed one
    reads as NaN: estimators leave it out of every baseline, and the data adapter then rejects it."""
    reward = _outcome_reward_source(trajectory)
    if reward is None:
        return None
    try:
        return real_scalar("", None, "reward", reward, "")
    except MalformedTrajectoryError:
        return float("nan")


def check_group(group: Any, label: str) -> list[Any]:
    """A group's trajectories; the group is unusable as a whole when they are not a list."""
    trajectories = getattr(group, "trajectories", None)
    if not isinstance(trajectories, list | tuple):
        raise MalformedTrajectoryError(
            label, None, "trajectories", f"is {show(trajectories)}", "a group holds a list of trajectories"
        )
    return list(trajectories)


def check_group_id(group: Any, label: str) -> str:
    """The group's id, which becomes SkyRL's uid for each of its rows; ``label`` names the trajectory."""
    group_id = getattr(group, "group_id", None)
    if not isinstance(group_id, str) or not group_id:
        problem = f"the group's id is {show(group_id)}, not a non-empty string"
        remedy = "name the group '<task_id>:<role>' (it identifies the rows that share a prompt)"
        raise MalformedTrajectoryError(label, None, "group_id", problem, remedy)
    return group_id


def check_role(trajectory: Any, label: str, config: RowRules) -> None:
    if config.allowed_roles is None:
        return
    role = getattr(trajectory, "name", None)
    if not isinstance(role, str) or role not in config.allowed_roles:
        problem = f"unknown role {show(role)} (configured roles: {sorted(config.allowed_roles)})"
        remedy = "name the trajectory after a configured role, or add its role to the config"
        raise MalformedTrajectoryError(label, None, "name", problem, remedy)


def trajectory_steps(trajectory: Any, label: str) -> list[Any] | tuple[Any, ...]:
    steps = getattr(trajectory, "steps", None)
    if not isinstance(steps, list | tuple) or not steps:
        problem = "no steps" if isinstance(steps, list | tuple) else f"is {show(steps)}, not a list of steps"
        raise MalformedTrajectoryError(label, None, "steps", problem, "a trajectory needs a model call")
    return steps


def outcome_reward(trajectory: Any, label: str, config: RowRules) -> float:
    """The checked outcome reward (0 when advantages come with the steps and there is none); read
    after the steps are checked, so a broken last step is reported as itself, not a missing reward."""
    reward = _outcome_reward_source(trajectory)
    if reward is None and not config.use_precomputed_advantages:
        problem = "no reward on the trajectory or its last step"
        remedy = "set Trajectory.reward (or the last step's reward)"
        raise MalformedTrajectoryError(label, None, "reward", problem, remedy)
    remedy = "the reward function must return a finite number"
    return 0.0 if reward is None else real_scalar(label, None, "reward", reward, remedy)


_MISSING = object()


def required(label: str, index: int, step: Any, name: str) -> Any:
    """A field every step must carry; an absent one is named rather than an AttributeError."""
    value = getattr(step, name, _MISSING)
    if value is _MISSING:
        problem = f"the step ({type(step).__name__}) has no '{name}'"
        raise MalformedTrajectoryError(label, index, name, problem, "build steps as rLLM's Step")
    return value


def step_lineage(label: str, index: int, step: Any) -> Any:
    """``metadata["lineage_id"]``: which sub-agent's turns a step continues (``None``: the main one)."""
    metadata = getattr(step, "metadata", None)
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        remedy = "step metadata must be a dict or None"
        raise MalformedTrajectoryError(label, index, "metadata", f"is {show(metadata)}, not a dict", remedy)
    lineage = metadata.get("lineage_id")
    if lineage is None or isinstance(lineage, str) or isinstance(lineage, Integral) and not is_bool(lineage):
        return lineage
    remedy = "a lineage_id names a sub-agent: a string or an integer"
    raise MalformedTrajectoryError(label, index, "metadata", f"lineage_id is {show(lineage)}", remedy)
