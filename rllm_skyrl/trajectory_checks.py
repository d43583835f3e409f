"""What a trajectory must satisfy to become a training row, checked field by field.

Every failure is a ``MalformedTrajectoryError`` naming the episode (or trajectory), the step and
the field, and saying what to fix; ``data_adapter`` raises it, or drops the trajectory and counts
it when ``drop_malformed`` is on. Inputs are read by attribute, so rLLM's pydantic types and
``rllm_skyrl.records`` both work. Nothing is coerced: a value either reaches the tensors as itself
(ids as int64, reals rounded to float32 as SkyRL's own builder does) or the trajectory is rejected.

What is accepted (only fields the conversion reads are checked):

* integers: what ``operator.index`` accepts (``int``, numpy integer scalars, 0-d integer arrays),
  never ``bool`` / ``numpy.bool_``; no floats (not even ``3.0``), no strings.
* real numbers: what ``float()`` accepts without parsing text (``float``, ``int``, numpy and torch
  scalars, ``Decimal``, ``Fraction``), never ``bool`` / ``numpy.bool_``, never ``str`` or
  ``bytes``; finite and within float32's range (the tensors are float32).
* id and value lists: a ``list`` or ``tuple`` of such numbers, or a 1-D numpy array of an integer
  (ids) or integer/float (values) dtype. Anything else (``None``, strings, sets, tensors, nested
  lists) is rejected.
* token ids: ``0 <= id < vocab_size`` (``0 <= id < 2**63`` when the vocabulary size is unknown).
* ``step.logprobs``: one per response token, finite and ``<= LOGPROB_TOLERANCE``.
* ``step.metadata``: absent, ``None`` or a mapping; its ``lineage_id`` absent, ``None``, a ``str`` or
  an integer.
* ``trajectory.reward``: ``None`` (then the last step's ``reward``) or a finite real.
* ``trajectory.steps``: a non-empty list or tuple; ``group.trajectories``: a list or tuple;
  ``group.group_id``: a non-empty ``str`` (it becomes SkyRL's uid); ``trajectory.name``: a
  configured role when roles are configured. ``group.metadata`` and ``trajectory.uid`` only name
  things in messages and are used when usable.

Element checks are vectorised: a list is packed in one ``struct.pack`` call (C code that rejects
what is not an integer / real number, a few ns per element) and checked with numpy; only elements
whose value is 0 or 1, the only values a ``bool`` can take, are looked at one by one. Trajectories
of plain lists are checked by the same criteria a chunk of them at a time (``BatchReads``); one that
may be malformed is then checked step by step, so that its first problem is the one named.
"""

from __future__ import annotations

import math
import operator
import struct
from array import array
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from itertools import accumulate
from numbers import Integral
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

# A sampled token's logprob is log p <= 0. Inference engines compute it as logit - logsumexp in
# float32, where rounding can leave a value a few ulps above 0; 1e-4 covers float32 rounding at
# any realistic logit scale (ulp(1000) = 6e-5) and is far too small to move an importance ratio
# (exp(1e-4) - 1 = 0.01%). Accepted values are passed through unchanged, not clipped.
LOGPROB_TOLERANCE = 1e-4

_INT64_LIMIT = 2**63
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_TEXT = (str, bytes, bytearray)
_PLAIN = (list, tuple)


class RowRules(Protocol):
    """The parts of ``data_adapter.BatchConfig`` the checks read."""

    allowed_roles: Collection[str] | None
    vocab_size: int | None
    use_precomputed_advantages: bool


class MalformedTrajectoryError(ValueError):
    """A trajectory that cannot become a training row; names the item, the field and the fix."""

    def __init__(self, label: str, step_index: int | None, field_name: str, problem: str, remedy: str):
        where = label if step_index is None else f"{label} step {step_index}"
        super().__init__(f"{where}, {field_name}: {problem}; {remedy}")
        self.label = label
        self.step_index = step_index
        self.field_name = field_name


# ---------------------------------------------------------------------------------------- labels


def group_role(group: Any) -> str:
    """The role a group trains (``"task:role"`` -> ``"role"``), as rLLM's ``group_role`` defines it.

    Never raises: a group without a usable id counts as ``"all_groups"`` here and is rejected by
    ``check_group_id`` when it is converted.
    """
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
        ident = f"trajectory #{traj_index} of group {_show(getattr(group, 'group_id', None))}"
    return f"{ident} (role {_show(getattr(trajectory, 'name', None))})"


def group_label(group: Any, group_index: int) -> str:
    return f"group #{group_index} {_show(getattr(group, 'group_id', None))}"


def _show(value: Any) -> str:
    """A short, unambiguous rendering of a bad value for a message: repr, and the type when unclear."""
    try:
        text = repr(value)
    except Exception:  # a message must not fail on the value it describes
        text = "<unprintable>"
    text = text if len(text) <= 40 else text[:37] + "..."
    if isinstance(value, str | int | float | type(None)) and not isinstance(value, bool):
        return text
    return f"{text} ({type(value).__name__})"


# ---------------------------------------------------------------------------------- number reads


def _is_bool(value: Any) -> bool:
    if isinstance(value, bool | np.bool_):
        return True
    dtype = getattr(value, "dtype", None)
    return (isinstance(value, np.ndarray) and dtype == np.bool_) or (
        isinstance(value, torch.Tensor) and dtype == torch.bool
    )


_PLAIN_NUMBERS = frozenset({int, float})


def _first_bool(values: Any, positions: np.ndarray) -> int | None:
    """The first of ``positions`` (elements whose value is 0 or 1) that holds a bool, if any."""
    if not positions.size:
        return None
    index = positions.tolist()
    items = operator.itemgetter(*index)(values) if len(index) > 1 else (values[index[0]],)
    if set(map(type, items)) <= _PLAIN_NUMBERS:
        return None
    return next((i for i, item in zip(index, items, strict=True) if _is_bool(item)), None)


def _pack(values: list | tuple, code: str) -> bytes:
    """``values`` as native int64 (``code="q"``) or float64 (``"d"``) bytes; raises if one is not an
    integer (``operator.index``) / real number (``float()`` of a non-text value).

    A bound ``Struct.pack(*values)`` takes the list as its only star-argument and copies it into one
    tuple; ``struct.pack(fmt, *values)`` copies it into a list and that list into a tuple, which
    costs a tenth more per element."""
    return struct.Struct(f"{len(values)}{code}").pack(*values)


def _packed(values: list | tuple, code: str) -> np.ndarray | None:
    """``values`` as a native int64 (``code="q"``) or float64 (``"d"``) array; ``None`` if one is not
    an integer (``operator.index``) / real number (``float()`` of a non-text value)."""
    try:
        packed = _pack(values, code)
    except Exception:  # struct.error, or whatever a value's own __index__ / __float__ raised
        return None
    return np.frombuffer(packed, dtype=np.int64 if code == "q" else np.float64)


def _first_rejected(values: Any, code: str) -> tuple[int, Any]:
    """Where ``_packed(values, code)`` failed: the first element it rejects on its own."""
    return next((i, item) for i, item in enumerate(values) if _packed([item], code) is None)


def _container_problem(value: Any, what: str) -> str:
    if isinstance(value, np.ndarray):
        return f"is a numpy array of dtype {value.dtype} and shape {value.shape}, not a 1-D {what} array"
    return f"is {_show(value)}, not a list of {what}s"


def int_ids(label: str, index: int | None, name: str, value: Any, vocab_size: int | None) -> np.ndarray:
    """A list/tuple of integers or a 1-D integer numpy array -> int64 ids, each in ``[0, vocab)``."""

    def bad(problem: str, remedy: str) -> MalformedTrajectoryError:
        return MalformedTrajectoryError(label, index, name, problem, remedy)

    from_list = isinstance(value, list | tuple)
    if from_list:
        ids = _packed(value, "q")
        if ids is None:
            position, item = _first_rejected(value, "q")
            raise bad(
                f"element {position} is {_show(item)}", "token ids must be integers (int or numpy integer)"
            )
    elif isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu":
        ids = value
    else:
        raise bad(_container_problem(value, "integer"), "pass the token ids as a list of ints")
    if not ids.size:
        return ids.astype(np.int64)
    low, high = int(np.minimum.reduce(ids)), int(np.maximum.reduce(ids))
    if from_list and low <= 1:  # a bool reads as 0 or 1
        position = _first_bool(value, np.flatnonzero(ids.view(np.uint64) <= 1))
        if position is not None:
            raise bad(
                f"element {position} is {value[position]!r} (a bool)", "token ids must be integers, not bool"
            )
    limit = _INT64_LIMIT if vocab_size is None else vocab_size
    if low < 0 or high >= limit:
        position = next(i for i, t in enumerate(ids.tolist()) if not 0 <= t < limit)
        span = "[0, 2**63)" if vocab_size is None else f"the vocabulary [0, {vocab_size})"
        raise bad(
            f"token id {int(ids[position])} at position {position} is outside {span}",
            "the sampler returned an id the trainer's model cannot embed; check both use the same model",
        )
    return ids if from_list else ids.astype(np.int64, copy=False)


def real_values(
    label: str, index: int | None, name: str, value: Any, length: int, remedy: str, at_most: float = math.inf
) -> np.ndarray:
    """A list/tuple of real numbers or a 1-D numeric numpy array -> float64: ``length`` finite values,
    none above ``at_most``."""

    def bad(problem: str, fix: str = remedy) -> MalformedTrajectoryError:
        return MalformedTrajectoryError(label, index, name, problem, fix)

    from_list = isinstance(value, list | tuple)
    if from_list:
        values = _packed(value, "d")
        if values is None:
            position, item = _first_rejected(value, "d")
            raise bad(f"element {position} is {_show(item)}", "values must be real numbers (float or int)")
    elif isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iuf":
        values = value.astype(np.float64, copy=False)
    else:
        raise bad(_container_problem(value, "number"), f"pass one number per response token; {remedy}")
    if len(values) != length:
        raise bad(f"{len(values)} values for {length} response tokens")
    if not length:
        return values
    low, high = float(np.minimum.reduce(values)), float(np.maximum.reduce(values))  # NaN -> NaN
    if from_list and low <= 1.0 and high >= 0.0:  # a bool reads as 0.0 or 1.0
        position = _first_bool(value, np.flatnonzero((values == 0.0) | (values == 1.0)))
        if position is not None:
            raise bad(
                f"element {position} is {value[position]!r} (a bool)", "values must be real numbers, not bool"
            )
    if not (math.isfinite(low) and math.isfinite(high)):
        position = int(np.flatnonzero(~np.isfinite(values))[0])
        raise bad(f"element {position} is {values[position]}")
    if low < -_FLOAT32_MAX or high > _FLOAT32_MAX:
        position = int(np.flatnonzero(np.abs(values) > _FLOAT32_MAX)[0])
        raise bad(f"element {position} is {values[position]}, outside float32's range")
    if high > at_most:
        position = int(np.flatnonzero(values > at_most)[0])
        raise bad(f"element {position} is {values[position]}, above {at_most}")
    return values


def real_scalar(label: str, index: int | None, name: str, value: Any, remedy: str) -> float:
    """One finite real number (see the module docstring), as a Python float."""
    if type(value) is float and abs(value) <= _FLOAT32_MAX:  # the common case, without packing (NaN fails)
        return value
    if _is_bool(value) or isinstance(value, _TEXT):
        raise MalformedTrajectoryError(label, index, name, f"is {_show(value)}, not a number", remedy)
    packed = _packed([value], "d")
    if packed is None:
        raise MalformedTrajectoryError(label, index, name, f"is {_show(value)}, not a number", remedy)
    number = float(packed[0])
    if not math.isfinite(number):
        raise MalformedTrajectoryError(label, index, name, f"is {number}", remedy)
    if abs(number) > _FLOAT32_MAX:
        raise MalformedTrajectoryError(label, index, name, f"is {number}, outside float32's range", remedy)
    return number


# ------------------------------------------------------------------------------- trajectory reads


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
    """The outcome reward for statistics and estimators; ``None`` when there is none. Never raises.

    A malformed reward reads as NaN, so estimators leave it out of every baseline and the data
    adapter then rejects (or drops and counts) the trajectory with the reason.
    """
    reward = _outcome_reward_source(trajectory)
    if reward is None:
        return None
    try:
        return real_scalar("", None, "reward", reward, "")
    except MalformedTrajectoryError:
        return math.nan


def check_group(group: Any, label: str) -> list[Any]:
    """A group's trajectories; the group is unusable as a whole when they are not a list."""
    trajectories = getattr(group, "trajectories", None)
    if not isinstance(trajectories, list | tuple):
        raise MalformedTrajectoryError(
            label, None, "trajectories", f"is {_show(trajectories)}", "a group holds a list of trajectories"
        )
    return list(trajectories)


def check_group_id(group: Any, label: str) -> str:
    """The group's id, which becomes SkyRL's uid for each of its rows; ``label`` names the trajectory."""
    group_id = getattr(group, "group_id", None)
    if not isinstance(group_id, str) or not group_id:
        raise MalformedTrajectoryError(
            label,
            None,
            "group_id",
            f"the group's id is {_show(group_id)}, not a non-empty string",
            "name the group '<task_id>:<role>' (it identifies the rows that share a prompt)",
        )
    return group_id


def check_trajectory(trajectory: Any, label: str, config: RowRules) -> list[Any]:
    """Trajectory-level checks (role, steps); returns the steps."""
    if config.allowed_roles is not None:
        role = getattr(trajectory, "name", None)
        if not isinstance(role, str) or role not in config.allowed_roles:
            raise MalformedTrajectoryError(
                label,
                None,
                "name",
                f"unknown role {_show(role)} (configured roles: {sorted(config.allowed_roles)})",
                "name the trajectory after a configured role, or add its role to the config",
            )
    steps = getattr(trajectory, "steps", None)
    if not isinstance(steps, list | tuple):
        raise MalformedTrajectoryError(
            label, None, "steps", f"is {_show(steps)}, not a list of steps", "a trajectory needs a model call"
        )
    if not steps:
        raise MalformedTrajectoryError(label, None, "steps", "no steps", "a trajectory needs a model call")
    return list(steps)


def outcome_reward(trajectory: Any, label: str, config: RowRules) -> float:
    """The checked outcome reward (0 when advantages come with the steps and there is none).

    Read after the steps are checked, so a broken last step is reported as itself rather than as
    a missing fallback reward.
    """
    reward = _outcome_reward_source(trajectory)
    if reward is None and not config.use_precomputed_advantages:
        raise MalformedTrajectoryError(
            label,
            None,
            "reward",
            "no reward on the trajectory or its last step",
            "set Trajectory.reward (or the last step's reward)",
        )
    remedy = "the reward function must return a finite number"
    return 0.0 if reward is None else real_scalar(label, None, "reward", reward, remedy)


class StepRun(NamedTuple):
    """A checked step, as the merge into rows reads it: its prompt then its response ids are one run
    ``[start, stop)`` of an int64 buffer ``ids`` (the prompt ``[start, middle)``); its logprobs and,
    when the batch needs them, its advantages (a scalar when one value holds for every token)."""

    ids: np.ndarray
    start: int
    middle: int
    stop: int
    logprobs: np.ndarray
    advantages: np.ndarray | float | None


class StepFields(NamedTuple):
    """One step's checked arrays; ``advantages`` is a scalar when it is one value for every token."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    logprobs: np.ndarray
    advantages: np.ndarray | float | None

    def run(self) -> StepRun:
        """The step as a run of a buffer of its own."""
        ids = np.concatenate([self.prompt_ids, self.response_ids])
        return StepRun(ids, 0, len(self.prompt_ids), len(ids), self.logprobs, self.advantages)


_MISSING = object()


def _required(label: str, index: int, step: Any, name: str) -> Any:
    """A field every step must carry; an absent one is named rather than an AttributeError."""
    value = getattr(step, name, _MISSING)
    if value is _MISSING:
        raise MalformedTrajectoryError(
            label,
            index,
            name,
            f"the step ({type(step).__name__}) has no '{name}'",
            "build steps as rLLM's Step",
        )
    return value


def step_lineage(label: str, index: int, step: Any) -> Any:
    """``metadata["lineage_id"]``: which sub-agent's turns a step continues (``None``: the main one)."""
    metadata = getattr(step, "metadata", None)
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise MalformedTrajectoryError(
            label,
            index,
            "metadata",
            f"is {_show(metadata)}, not a dict",
            "step metadata must be a dict or None",
        )
    lineage = metadata.get("lineage_id")
    if (
        lineage is None
        or isinstance(lineage, str)
        or (isinstance(lineage, Integral) and not _is_bool(lineage))
    ):
        return lineage
    raise MalformedTrajectoryError(
        label,
        index,
        "metadata",
        f"lineage_id is {_show(lineage)}",
        "a lineage_id names a sub-agent: a string or an integer",
    )


def step_fields(
    label: str, index: int, step: Any, config: RowRules, advantage: float | None, needs_advantages: bool
) -> StepFields:
    """One step's checked ids, logprobs and (when needed) advantages: ``advantage`` is the
    trajectory's scalar, else (``use_precomputed_advantages``) the step's own ``advantage``."""
    prompt_ids = int_ids(
        label, index, "prompt_ids", _required(label, index, step, "prompt_ids"), config.vocab_size
    )
    response_ids = int_ids(
        label, index, "response_ids", _required(label, index, step, "response_ids"), config.vocab_size
    )
    if not response_ids.size:
        raise MalformedTrajectoryError(
            label, index, "response_ids", "empty response", "drop steps where the model produced no tokens"
        )
    n = response_ids.size
    logprobs = real_values(
        label,
        index,
        "logprobs",
        _required(label, index, step, "logprobs"),
        n,
        "the rollout engine must return one log p <= 0 per sampled token (logprobs, not logits)",
        at_most=LOGPROB_TOLERANCE,
    )
    if not needs_advantages:
        return StepFields(prompt_ids, response_ids, logprobs, None)
    if advantage is not None:
        return StepFields(prompt_ids, response_ids, logprobs, advantage)
    return StepFields(prompt_ids, response_ids, logprobs, _step_advantages(label, index, step, n))


def _step_advantages(label: str, index: int, step: Any, n_response: int) -> np.ndarray | float:
    """A step's precomputed advantage: one finite real, or one per response token."""
    value = getattr(step, "advantage", None)
    remedy = "with use_precomputed_advantages every step needs a finite float or one per response token"
    if value is None:
        raise MalformedTrajectoryError(label, index, "advantage", "step.advantage is None", remedy)
    if isinstance(value, list | tuple | np.ndarray):
        return real_values(label, index, "advantage", value, n_response, remedy)
    return real_scalar(label, index, "advantage", value, remedy)


class _Span(NamedTuple):
    """Where one trajectory's lists sit in its chunk: ``id_lists[first : first + 2 * steps]``."""

    first: int
    steps: int
    first_logprobs: int


class _Chunk:
    """Consecutive trajectories read together: ids into one growing buffer, logprobs packed, then
    checked with a few reductions for all of them; each one alone only when that check fails."""

    def __init__(self, vocab_size: int | None) -> None:
        self.vocab_size = vocab_size
        self.buffer = array("Q")
        self.id_lists: list[list | tuple] = []
        self.logprob_lists: list[list | tuple] = []
        self.logprob_parts: list[bytes] = []

    def read(self, steps: Sequence[Any]) -> _Span | None:
        """Append a trajectory's lists; ``None`` (nothing appended) when one is not plain or not packable."""
        span = _Span(len(self.id_lists), len(steps), len(self.logprob_lists))
        buffered = len(self.buffer)
        if self._read(steps):
            return span
        # undone: what it appended would shift every later trajectory's bounds
        del self.buffer[buffered:], self.id_lists[span.first :]
        del self.logprob_lists[span.first_logprobs :], self.logprob_parts[span.first_logprobs :]
        return None

    def _read(self, steps: Sequence[Any]) -> bool:
        for step in steps:
            prompt_ids = getattr(step, "prompt_ids", None)
            response_ids = getattr(step, "response_ids", None)
            logprobs = getattr(step, "logprobs", None)
            if not (type(prompt_ids) in _PLAIN and type(response_ids) in _PLAIN and type(logprobs) in _PLAIN):
                return False
            if not response_ids or len(logprobs) != len(response_ids):
                return False
            try:
                for ids in (prompt_ids, response_ids):
                    if type(ids) is list:
                        self.buffer.fromlist(ids)  # appends nothing when an element is refused
                    else:
                        self.buffer.extend(array("Q", ids))
                    self.id_lists.append(ids)
                self.logprob_parts.append(_pack(logprobs, "d"))
            except Exception:  # an element that is not a number, or a negative id: step_fields names it
                return False
            self.logprob_lists.append(logprobs)
        return True

    def close(self) -> None:
        """No more reads: the buffers become arrays, and the whole chunk is checked once."""
        self.ids = np.frombuffer(self.buffer, dtype=np.int64)
        self.logprobs = np.frombuffer(b"".join(self.logprob_parts), dtype=np.float64)
        self.bounds = list(accumulate(map(len, self.id_lists), initial=0))
        self.logprob_bounds = list(accumulate(map(len, self.logprob_lists), initial=0))
        self.all_clean = self._clean(_Span(0, len(self.logprob_lists), 0))

    def _clean(self, span: _Span) -> bool:
        """Whether every list of ``span`` passes ``int_ids``'s and ``real_values``'s checks."""
        if not span.steps:
            return True
        ids = self.bounds[span.first : span.first + 2 * span.steps + 1]
        values = self.logprob_bounds[span.first_logprobs : span.first_logprobs + span.steps + 1]
        return _clean_ids(
            self.ids[ids[0] : ids[-1]],
            self.id_lists[span.first : span.first + 2 * span.steps],
            [b - ids[0] for b in ids],
            self.vocab_size,
        ) and _clean_logprobs(
            self.logprobs[values[0] : values[-1]],
            self.logprob_lists[span.first_logprobs : span.first_logprobs + span.steps],
            [b - values[0] for b in values],
        )

    def steps(
        self, span: _Span, label: str, steps: Sequence[Any], advantage: float | None, needs_advantages: bool
    ) -> list[StepRun] | None:
        if not (self.all_clean or self._clean(span)):
            return None
        bounds, logprob_bounds = self.bounds, self.logprob_bounds
        runs: list[StepRun] = []
        for k, step in enumerate(steps):
            start, middle, stop = bounds[span.first + 2 * k : span.first + 2 * k + 3]
            if not needs_advantages or advantage is not None:
                advantages = advantage if needs_advantages else None
            else:
                try:
                    advantages = _step_advantages(label, k, step, stop - middle)
                except Exception:  # met by step_fields in order, after earlier steps' own problems
                    return None
            j = span.first_logprobs + k
            step_logprobs = self.logprobs[logprob_bounds[j] : logprob_bounds[j + 1]]
            runs.append(StepRun(self.ids, start, middle, stop, step_logprobs, advantages))
        return runs


class BatchReads:
    """The ids and logprobs of a batch's trajectories, read a chunk of trajectories at a time and
    checked a chunk at once, as the conversion asks for them.

    Why: a multi-turn trajectory re-sends the conversation so far in every prompt, so ids are most
    of what is read, and ``step_fields`` adds about ten numpy calls per step; checking a trajectory
    at a time still cost a dozen numpy calls each, which at a small model's shape (hundreds of rows
    of a few dozen tokens) was most of the conversion. Ids are appended with ``array.fromlist``,
    straight from each list into the chunk's buffer (half the time per element of an array per list,
    or of ``struct``, which copies the list into a tuple first); logprobs are packed by ``struct``.
    ``array("Q")`` takes the integers (``int`` or ``__index__``) in ``[0, 2**64)``, so what it
    refuses ``int_ids`` refuses too, and the range check turns away the rest. A chunk holds about
    ``CHUNK_IDS`` ids: small enough that its buffer is still in the core's cache when its rows are
    merged (one buffer for a whole 2 M-token batch made the conversion slower, not faster).

    A trajectory gets no reads (``steps`` returns ``None``, and the caller runs ``step_fields`` step
    by step, which accepts numpy arrays and names the first problem in order) when its steps are
    not a non-empty list or tuple of steps whose ids and logprobs are plain lists or tuples (not
    subclasses: ``array`` reads those by index, ``struct`` by iteration), or might be malformed.
    """

    CHUNK_IDS = 1 << 17  # 1 MiB of int64 ids

    def __init__(self, trajectories: Iterable[tuple[Any, Any]], config: RowRules) -> None:
        """``trajectories``: ``(key, trajectory)`` in the order ``steps`` will ask for them by key."""
        self._vocab_size = config.vocab_size
        self._pending: Iterator[tuple[Any, Any]] | None = iter(trajectories)
        self._spans: dict[Any, tuple[_Chunk, _Span] | None] = {}

    def _read_chunk(self) -> None:
        chunk = _Chunk(self._vocab_size)
        for key, trajectory in self._pending:
            steps = getattr(trajectory, "steps", None)
            span = chunk.read(steps) if isinstance(steps, list | tuple) and steps else None
            self._spans[key] = None if span is None else (chunk, span)
            if len(chunk.buffer) >= self.CHUNK_IDS:
                break
        else:
            self._pending = None
        chunk.close()

    def steps(
        self, key: Any, label: str, steps: Sequence[Any], advantage: float | None, needs_advantages: bool
    ) -> list[StepRun] | None:
        """Each of ``steps`` (the checked steps of trajectory ``key``) as ``step_fields(...).run()``
        would give it, but a run of the chunk's buffers; or ``None``."""
        while key not in self._spans and self._pending is not None:
            self._read_chunk()
        entry = self._spans.get(key)
        if entry is None or entry[1].steps != len(steps):
            return None
        chunk, span = entry
        return chunk.steps(span, label, steps, advantage, needs_advantages)


def _clean_ids(ids: np.ndarray, lists: list[Any], bounds: list[int], vocab_size: int | None) -> bool:
    """Whether ``int_ids`` accepts each of ``lists`` (``ids[bounds[i]:bounds[i + 1]]``): in range, no bool."""
    unsigned = ids.view(np.uint64)  # an id of 2**63 or more (read as unsigned) must not look negative
    limit = _INT64_LIMIT if vocab_size is None else min(vocab_size, _INT64_LIMIT)
    if int(np.maximum.reduce(unsigned)) >= limit:
        return False
    return int(np.minimum.reduce(unsigned)) > 1 or not _holds_bool(lists, bounds, unsigned <= 1)


def _clean_logprobs(values: np.ndarray, lists: list[Any], bounds: list[int]) -> bool:
    """Whether ``real_values`` accepts each of ``lists`` (``values[bounds[i]:bounds[i + 1]]``) as logprobs."""
    low, high = float(np.minimum.reduce(values)), float(np.maximum.reduce(values))  # NaN -> NaN
    if not (math.isfinite(low) and math.isfinite(high)) or low < -_FLOAT32_MAX or high > LOGPROB_TOLERANCE:
        return False
    return low > 1.0 or high < 0.0 or not _holds_bool(lists, bounds, (values == 0.0) | (values == 1.0))


def _holds_bool(lists: list[Any], bounds: list[int], flagged: np.ndarray) -> bool:
    """Whether an element ``flagged`` (one worth 0 or 1) of one of ``lists``, packed end to end, is a bool.

    One pass over the flagged elements of every list: a small vocabulary's special tokens (ids 0
    and 1) flag an element in nearly every prompt, and a call per list cost milliseconds a step."""
    positions = np.flatnonzero(flagged)
    if not positions.size:
        return False
    starts = np.asarray(bounds[:-1])
    owners = np.searchsorted(starts, positions, side="right") - 1
    return any(
        type(item := lists[owner][offset]) not in _PLAIN_NUMBERS and _is_bool(item)
        for owner, offset in zip(owners.tolist(), (positions - starts[owners]).tolist(), strict=True)
    )
