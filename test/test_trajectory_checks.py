"""What a trajectory may hold: a malformed field is named, rejected or dropped and counted, never coerced."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import replace
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import Step, Trajectory, TrajectoryGroup, group_of

from rllm_skyrl.data.adapter import BatchConfig, sft_examples_to_batch, trajectory_groups_to_batch
from rllm_skyrl.data.trajectory_checks import (
    LOGPROB_TOLERANCE,
    MalformedTrajectoryError,
    group_role,
    trajectory_reward,
)

CONFIG = BatchConfig(pad_token_id=0, vocab_size=50, allowed_roles={"solver"})
LABEL = "episode 'task-3:1' (role 'solver')"


def two_steps() -> Trajectory:
    """A two-turn conversation (step 1 continues step 0) whose fields the table below corrupts."""
    steps = [
        Step([5, 6, 1], [7, 8], logprobs=[-0.5, -0.25]),
        Step([5, 6, 1, 7, 8, 9], [10, 0], logprobs=[-1.0, 0.0]),
    ]
    return Trajectory(steps, reward=1.0, uid="u-bad")


def batch_of(trajectory: Any, config: BatchConfig = CONFIG, advantages: Any = None):
    good = Trajectory([Step([3], [4], advantage=1.0)], uid="u-good")
    return trajectory_groups_to_batch([group_of(good, trajectory)], config, advantages)


def tensors(batch) -> dict[str, torch.Tensor]:
    return {key: batch[key] for key in batch.keys()}


def assert_same_batch(left, right) -> None:
    assert sorted(left.keys()) == sorted(right.keys())
    for key in left.keys():
        assert left[key].dtype == right[key].dtype and torch.equal(left[key], right[key]), key
    assert left.metadata == right.metadata


# ------------------------------------------------------------------------------------ accepted


def set_field(trajectory: Trajectory, path: str, value: Any) -> Trajectory:
    """``path`` is ``"reward"``, ``"steps"`` or ``"<step>.<field>"`` / ``"<step>.<field>[<i>]"``."""
    trajectory = copy.deepcopy(trajectory)
    if "." not in path:
        setattr(trajectory, path, value)
        return trajectory
    step_index, name = path.split(".")
    step = trajectory.steps[int(step_index)]
    if "[" in name:
        name, position = name.rstrip("]").split("[")
        getattr(step, name)[int(position)] = value
    else:
        setattr(step, name, value)
    return trajectory


class Index:
    """An integer by ``__index__`` only, as numpy's integer scalars are."""

    def __init__(self, value: int):
        self.value = value

    def __index__(self) -> int:
        return self.value


class IdList(list):
    """A list subclass: its items are read as its own iteration gives them."""


ACCEPTED = [
    ("0.prompt_ids", (5, 6, 1)),
    ("0.prompt_ids", IdList([5, 6, 1])),
    ("0.response_ids", [Index(7), np.uint64(8)]),
    ("0.prompt_ids", np.array([5, 6, 1], dtype=np.int32)),
    ("0.prompt_ids", np.array([5, 6, 1], dtype=np.uint16)),
    ("1.prompt_ids", [np.int64(t) for t in [5, 6, 1, 7, 8, 9]]),
    ("1.response_ids", np.array([10, 0])),
    ("0.logprobs", np.array([-0.5, -0.25], dtype=np.float32)),
    ("0.logprobs", [np.float32(-0.5), np.float16(-0.25)]),
    ("0.logprobs", (-0.5, Fraction(-1, 4))),
    ("1.logprobs", [-1, 0]),  # ints are exact reals
    ("1.logprobs", [Decimal("-1"), np.float64(0.0)]),
    ("reward", 1),
    ("reward", np.float32(1.0)),
    ("reward", torch.tensor(1.0)),
    ("0.metadata", None),
    ("0.metadata", {"lineage_id": None}),
]


@pytest.mark.parametrize(("path", "value"), ACCEPTED)
def test_accepted_representations_give_the_same_rows(path, value):
    """Every accepted spelling of a value produces exactly the batch of the plain-list spelling."""
    assert_same_batch(batch_of(set_field(two_steps(), path, value))[0], batch_of(two_steps())[0])


def test_scalar_advantages_may_be_numpy_or_tensor_scalars():
    plain = batch_of(two_steps(), advantages=[[0.5, -1.5]])[0]
    for spelling in ([np.float32(0.5), -1.5], torch.tensor([0.5, -1.5]), [0.5, np.int64(-1) - 0.5]):
        assert_same_batch(batch_of(two_steps(), advantages=[spelling])[0], plain)


def test_logprobs_may_exceed_zero_by_float_noise_only():
    within = set_field(two_steps(), "1.logprobs", [-1.0, LOGPROB_TOLERANCE])
    batch, _ = batch_of(within)
    assert batch["rollout_logprobs"][1, -1].item() == pytest.approx(LOGPROB_TOLERANCE)  # passed through
    with pytest.raises(MalformedTrajectoryError, match=r"step 1, logprobs: element 1 is 0.0002, above"):
        batch_of(set_field(two_steps(), "1.logprobs", [-1.0, 2 * LOGPROB_TOLERANCE]))


# ------------------------------------------------------------------------------------ rejected


class Raising:
    """A value whose own conversions and repr fail: still a labelled error, never an escaping one."""

    def __index__(self):
        raise RuntimeError("no index")

    def __float__(self):
        raise RuntimeError("no float")

    def __repr__(self):
        raise RuntimeError("no repr")


NOT_INTS = [3.7, 3.0, "7", True, False, np.True_, None, np.float64(2.0), Decimal(3), 1 + 0j, [1], b"1"]
NOT_INTS += [Raising()]
NOT_REALS = ["-0.1", True, False, np.True_, None, [-0.1], 1j, b"-1", torch.tensor([True]), Raising()]

REJECTED = [
    # (field path, bad value, field name reported, step reported, message fragment)
    *[("0.response_ids[1]", v, "response_ids", 0, "element 1 is ") for v in NOT_INTS],
    *[("1.prompt_ids[4]", v, "prompt_ids", 1, "element 4 is ") for v in NOT_INTS],  # inside the prefix
    (
        "0.response_ids[0]",
        -1,
        "response_ids",
        0,
        "token id -1 at position 0 is outside the vocabulary [0, 50)",
    ),
    ("0.response_ids[0]", 50, "response_ids", 0, "token id 50 at position 0 is outside"),
    ("0.response_ids[0]", 2**70, "response_ids", 0, "element 0 is 1180591620717411303424"),
    ("0.response_ids[0]", 2**63, "response_ids", 0, "element 0 is 9223372036854775808"),
    ("0.response_ids[0]", np.uint64(2**63), "response_ids", 0, "element 0 is np.uint64(9223372036"),
    ("0.response_ids[0]", Index(-1), "response_ids", 0, "token id -1 at position 0 is outside"),
    ("1.prompt_ids[4]", Index(2**64), "prompt_ids", 1, "element 4 is <"),
    ("0.response_ids", None, "response_ids", 0, "is None, not a list of integers"),
    ("0.response_ids", "78", "response_ids", 0, "is '78', not a list of integers"),
    ("0.response_ids", {7, 8}, "response_ids", 0, "not a list of integers"),
    ("0.response_ids", torch.tensor([7, 8]), "response_ids", 0, "not a list of integers"),
    ("0.response_ids", np.array([7.0, 8.0]), "response_ids", 0, "numpy array of dtype float64"),
    ("0.response_ids", np.array([[7, 8]]), "response_ids", 0, "shape (1, 2), not a 1-D integer array"),
    ("0.response_ids", np.array([True, False]), "response_ids", 0, "numpy array of dtype bool"),
    ("0.response_ids", [], "response_ids", 0, "empty response"),
    ("0.prompt_ids", [], "prompt_ids", 0, "empty prompt"),
    *[("1.logprobs[1]", v, "logprobs", 1, "element 1 is ") for v in NOT_REALS],
    ("1.logprobs[0]", math.nan, "logprobs", 1, "element 0 is nan"),
    ("1.logprobs[0]", -math.inf, "logprobs", 1, "element 0 is -inf"),
    ("1.logprobs[0]", 5.0, "logprobs", 1, "element 0 is 5.0, above 0.0001"),
    ("1.logprobs[0]", -1e39, "logprobs", 1, "element 0 is -1e+39, outside float32's range"),
    ("reward", 10**39, "reward", None, "reward: is 1e+39, outside float32's range"),
    ("1.logprobs", [-1.0], "logprobs", 1, "1 values for 2 response tokens"),
    ("1.logprobs", None, "logprobs", 1, "is None, not a list of numbers"),
    ("1.logprobs", np.array([True, False]), "logprobs", 1, "numpy array of dtype bool"),
    ("1.metadata", [("lineage_id", "a")], "metadata", 1, "is [('lineage_id', 'a')] (list), not a dict"),
    ("1.metadata", "lineage", "metadata", 1, "not a dict"),
    ("1.metadata", {"lineage_id": ["a"]}, "metadata", 1, "lineage_id is ['a'] (list)"),
    ("1.metadata", {"lineage_id": True}, "metadata", 1, "lineage_id is True (bool)"),
    ("1.metadata", {"lineage_id": 1.5}, "metadata", 1, "lineage_id is 1.5"),
    *[("reward", v, "reward", None, "reward: is ") for v in ["1.0", True, np.True_, [1.0], {}, 1j]],
    ("reward", math.nan, "reward", None, "reward: is nan"),
    ("steps", None, "steps", None, "steps: is None, not a list of steps"),
    ("steps", "ab", "steps", None, "not a list of steps"),
    ("steps", [], "steps", None, "no steps"),
    ("steps", [None], "prompt_ids", 0, "the step (NoneType) has no 'prompt_ids'"),
    ("name", "judge", "name", None, "unknown role 'judge'"),
    ("name", ["solver"], "name", None, "unknown role ['solver']"),
]


@pytest.mark.parametrize(("path", "value", "field_name", "step", "fragment"), REJECTED)
def test_malformed_fields_are_named_and_never_coerced(path, value, field_name, step, fragment):
    bad = set_field(two_steps(), path, value)
    with pytest.raises(MalformedTrajectoryError) as err:
        batch_of(bad)
    message = str(err.value)
    if path == "name":  # the label shows the role, which is the bad value here
        assert message.startswith("episode 'task-3:1' (role ") and "), name: " in message
    else:
        where = LABEL if step is None else f"{LABEL} step {step}"
        assert message.startswith(f"{where}, {field_name}: ")
    assert fragment in message
    assert (err.value.field_name, err.value.step_index) == (field_name, step)
    # Dropped instead, the rest of the batch is exactly the batch without it.
    batch, stats = batch_of(bad, replace(CONFIG, drop_malformed=True))
    good = Trajectory([Step([3], [4], advantage=1.0)], uid="u-good")
    alone, _ = trajectory_groups_to_batch([group_of(good)], CONFIG)
    assert_same_batch(batch, alone)
    assert stats.dropped_malformed == 1 and stats.drop_fields == (field_name,)
    assert stats.metrics()[f"batch/dropped_malformed/{field_name}"] == 1.0


def without(step: Step, name: str) -> SimpleNamespace:
    fields = {k: v for k, v in vars(step).items() if k != name}
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("name", ["prompt_ids", "response_ids", "logprobs"])
def test_a_missing_step_field_is_named(name):
    trajectory = two_steps()
    trajectory.steps[1] = without(trajectory.steps[1], name)
    with pytest.raises(
        MalformedTrajectoryError, match=f"step 1, {name}: the step .SimpleNamespace. has no '{name}'"
    ):
        batch_of(trajectory)


def test_missing_optional_fields_read_as_none():
    """``metadata`` absent means no lineage; ``reward`` absent falls back to the last step's."""
    trajectory = two_steps()
    trajectory.steps = [without(step, "metadata") for step in trajectory.steps]
    trajectory.steps[-1].reward = 1.0
    plain = SimpleNamespace(steps=trajectory.steps, name="solver", uid="u-bad")
    assert_same_batch(batch_of(plain)[0], batch_of(two_steps())[0])


@pytest.mark.parametrize("value", [math.nan, "0.5", True, None, [0.5], math.inf])
def test_malformed_scalar_advantages_are_named(value):
    with pytest.raises(MalformedTrajectoryError, match=re.escape(f"{LABEL}, advantage: is ")):
        batch_of(two_steps(), advantages=[[0.5, value]])


@pytest.mark.parametrize("value", [[0.5, True], [0.5, "1"], "0.5", np.array([0.5, np.nan]), [0.5]])
def test_malformed_precomputed_advantages_are_named(value):
    trajectory = set_field(two_steps(), "1.advantage", value)
    trajectory.steps[0].advantage = 1.0
    config = replace(CONFIG, use_precomputed_advantages=True)
    with pytest.raises(MalformedTrajectoryError, match=re.escape(f"{LABEL} step 1, advantage: ")):
        batch_of(trajectory, config)


@pytest.mark.parametrize("group_id", [None, 5, "", b"task:solver"])
def test_a_group_without_a_string_id_drops_each_of_its_trajectories(group_id):
    group = group_of(two_steps(), two_steps())
    group.group_id = group_id
    with pytest.raises(
        MalformedTrajectoryError, match=re.escape(f"{LABEL.replace('1', '0')}, group_id: the group's id is")
    ):
        trajectory_groups_to_batch([group], CONFIG)
    fine = group_of(Trajectory([Step([3], [4])]), task="other")
    batch, stats = trajectory_groups_to_batch([group, fine], replace(CONFIG, drop_malformed=True))
    assert batch.metadata["uids"] == ["other:solver"]
    assert stats.dropped_malformed == 2 and stats.drop_fields == ("group_id", "group_id")


@pytest.mark.parametrize("trajectories", [None, "ab", 5, {"a": 1}])
def test_a_group_without_a_trajectory_list_counts_as_one_drop(trajectories):
    group = TrajectoryGroup(trajectories, "task-9:solver")  # type: ignore[arg-type]
    with pytest.raises(MalformedTrajectoryError, match="group #0 'task-9:solver', trajectories: is "):
        trajectory_groups_to_batch([group], CONFIG)
    fine = group_of(Trajectory([Step([3], [4])]))
    _, stats = trajectory_groups_to_batch([group, fine], replace(CONFIG, drop_malformed=True))
    assert stats.dropped_malformed == 1 and stats.drop_fields == ("trajectories",)


def test_readers_for_statistics_never_raise():
    """The estimators read rewards and roles before the adapter checks them; they must not crash."""
    assert math.isnan(trajectory_reward(Trajectory([Step([1], [2])], reward="1.0")))
    assert math.isnan(trajectory_reward(Trajectory([Step([1], [2])], reward=True)))
    assert trajectory_reward(Trajectory([Step([1], [2], reward=None)], reward=None)) is None
    assert trajectory_reward(SimpleNamespace()) is None
    assert trajectory_reward(Trajectory([Step([1], [2], reward=0.5)], reward=None)) == 0.5
    assert group_role(SimpleNamespace(group_id=None)) == "all_groups"
    assert group_role(SimpleNamespace(group_id="t:judge")) == "judge"


def test_rllm_records_are_checked_after_they_were_built():
    """rLLM's pydantic models validate on construction only; a later assignment is checked here."""
    rllm_types = pytest.importorskip("rllm.types")
    steps = [rllm_types.Step(prompt_ids=[5, 6], response_ids=[7, 8], logprobs=[-0.5, -0.25])]
    trajectory = rllm_types.Trajectory(name="solver", steps=steps, reward=1.0)
    group = rllm_types.TrajectoryGroup(
        trajectories=[trajectory],
        group_id="task-3:solver",
        metadata=[{"task_id": "task-3", "rollout_idx": 0}],
    )
    batch, _ = trajectory_groups_to_batch([group], CONFIG)
    assert batch["sequences"][0].tolist() == [5, 6, 7, 8]
    steps[0].response_ids[1] = True
    with pytest.raises(
        MalformedTrajectoryError, match="episode 'task-3:0' .role 'solver'. step 0, response_ids"
    ):
        trajectory_groups_to_batch([group], CONFIG)


@pytest.mark.parametrize(
    ("example", "fragment"),
    [
        (([1, True], [2]), "SFT example 1, prompt_ids: element 1 is True (a bool)"),
        (([1], [2.0]), "SFT example 1, response_ids: element 0 is 2.0"),
        (([1], "2"), "SFT example 1, response_ids: is '2', not a list of integers"),
        ([1, 2, 3], "SFT example 1, example: is [1, 2, 3]; pass (prompt_ids, response_ids) pairs"),
    ],
)
def test_sft_examples_follow_the_same_rules(example, fragment):
    with pytest.raises(MalformedTrajectoryError) as err:
        sft_examples_to_batch([([1], [2]), example], pad_token_id=0)
    assert fragment in str(err.value)
