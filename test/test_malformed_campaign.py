"""A generated campaign of malformed episodes mixed with valid ones.

Hypothesis builds batches of valid multi-turn trajectories (ids, logprobs and rewards in every
accepted spelling: lists, tuples, numpy arrays and scalars; sub-agent lineages; merged and
unmerged turns) and corrupts some of them, one field each, with a value from a catalogue of
what goes wrong in practice (floats, strings and bools as ids, text rewards, positive logprobs,
missing fields, dicts that are lists, unhashable lineage ids, groups without an id, ...).

For every batch: converting with ``drop_malformed=False`` raises ``MalformedTrajectoryError`` and
nothing else; each corrupted trajectory on its own raises one naming its episode, step and the
corrupted field; with ``drop_malformed=True`` every corrupted trajectory is dropped and counted
under its field, and the batch is exactly the batch of the valid trajectories alone, so no
malformed value reaches a tensor.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass, replace
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rllm_skyrl.data.adapter import BatchConfig, EmptyBatchError, trajectory_groups_to_batch
from rllm_skyrl.data.trajectory_checks import LOGPROB_TOLERANCE, MalformedTrajectoryError

VOCAB = 64
CONFIG = BatchConfig(
    pad_token_id=0, dp_size=2, max_seq_len=96, vocab_size=VOCAB, allowed_roles={"solver", "judge"}
)
MIN_MALFORMED = 1_000

# --------------------------------------------------------------------------------- valid episodes

ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)  # 0 and 1 look like bools
logprob = st.one_of(st.floats(-8.0, 0.0), st.sampled_from([0.0, -0.0, LOGPROB_TOLERANCE / 2]))


def spell_ids(draw: Any, values: list[int]) -> Any:
    kind = draw(st.sampled_from(["list", "tuple", "array", "numpy ints"]))
    if kind == "tuple":
        return tuple(values)
    if kind == "array":
        return np.array(values, dtype=draw(st.sampled_from([np.int64, np.int32, np.uint16])))
    return [np.int64(v) for v in values] if kind == "numpy ints" else list(values)


def spell_reals(draw: Any, values: list[float]) -> Any:
    kind = draw(st.sampled_from(["list", "tuple", "array", "float32 scalars"]))
    if kind == "tuple":
        return tuple(values)
    if kind == "array":
        return np.array(values, dtype=np.float64)
    return [np.float32(v) for v in values] if kind == "float32 scalars" else list(values)


@st.composite
def valid_trajectory(draw: Any) -> SimpleNamespace:
    """1-3 turns; a turn continues the conversation (merging) or starts afresh; optional sub-agents."""
    steps, sequence = [], []
    for turn in range(draw(st.integers(1, 3))):
        if turn and draw(st.booleans()):
            prompt = sequence + draw(st.lists(st.integers(0, VOCAB - 1), max_size=4))
        else:
            prompt = draw(ids)
        response = draw(ids)
        logprobs = draw(st.lists(logprob, min_size=len(response), max_size=len(response)))
        metadata = draw(st.sampled_from([None, {}, {"lineage_id": "sub"}, {"lineage_id": 7}, {"other": 1}]))
        steps.append(
            SimpleNamespace(
                prompt_ids=spell_ids(draw, prompt),
                response_ids=spell_ids(draw, response),
                logprobs=spell_reals(draw, logprobs),
                reward=draw(st.floats(-1, 1)),
                metadata=metadata,
            )
        )
        sequence = prompt + response
    reward = draw(st.one_of(st.floats(-1, 1), st.integers(-1, 1), st.builds(np.float32, st.floats(-1, 1))))
    if draw(st.integers(0, 5)) == 0:
        reward = None  # the last step's reward counts
    return SimpleNamespace(steps=steps, reward=reward, name=draw(st.sampled_from(["solver", "judge"])))


# ---------------------------------------------------------------------------------- corruptions

BAD_IDS = [3.7, 3.0, "7", True, False, np.True_, None, -1, VOCAB, VOCAB + 100, 2**64, [1]]
BAD_IDS += [np.float64(2.0), Decimal(3), 1 + 0j, b"1", np.uint64(2**63)]
BAD_ID_LISTS = [None, "abc", {1: 2}, frozenset({1}), 5, np.array([[1, 2]]), np.array([1.0]), np.array([True])]
BAD_ID_LISTS += [torch.tensor([1, 2]), np.array(["a"]), []]
BAD_REALS = [0.5, 5.0, math.nan, math.inf, -math.inf, "-0.1", None, True, False, np.True_, [-0.1], 1j]
BAD_REALS += [2 * LOGPROB_TOLERANCE, torch.tensor([True]), -1e39, -(10**39)]
BAD_REAL_LISTS = [None, "x", np.array([[-0.1]]), 3.0]
BAD_METADATA = [[1], "x", 5, {"lineage_id": [1]}, {"lineage_id": {}}, {"lineage_id": True}]
BAD_METADATA += [{"lineage_id": 1.5}, {"lineage_id": np.True_}, {"lineage_id": frozenset()}]
BAD_SCALARS = ["1.0", True, np.True_, math.nan, math.inf, [1.0], {}, 1j, torch.tensor([True]), 1e39]
BAD_STEPS = [None, 5, "ab", [], {}]
BAD_NAMES = ["critic", None, 5, ["solver"]]
BAD_GROUP_IDS = [None, 5, "", b"task:solver"]
BAD_TRAJECTORY_LISTS = [None, 5, "ab", {}]


def with_element(values: Any, position: int, bad: Any) -> list:
    out = list(values)
    out[position % len(out)] = bad
    return out


@st.composite
def corrupt(draw: Any, trajectory: SimpleNamespace, advantage: float) -> tuple[Any, Any, str]:
    """One field of a copy of ``trajectory`` (or its advantage) made malformed; returns the field name."""
    trajectory = copy.deepcopy(trajectory)
    steps = trajectory.steps
    index = draw(st.integers(0, len(steps) - 1))
    step = steps[index]
    kind = draw(
        st.sampled_from(
            ["ids", "id list", "logprobs", "logprob list", "missing", "metadata", "reward", "steps"]
            + ["name", "advantage", "sequence", "none step"]
        )
    )
    if kind in ("ids", "id list"):
        name = draw(st.sampled_from(["prompt_ids", "response_ids"]))
        if kind == "ids":
            bad = with_element(getattr(step, name), draw(st.integers(0, 99)), draw(st.sampled_from(BAD_IDS)))
        else:
            bad = draw(st.sampled_from(BAD_ID_LISTS))
        setattr(step, name, bad)
        return trajectory, advantage, name
    if kind == "logprobs":
        step.logprobs = with_element(
            step.logprobs, draw(st.integers(0, 99)), draw(st.sampled_from(BAD_REALS))
        )
        return trajectory, advantage, "logprobs"
    if kind == "logprob list":
        choice = draw(st.sampled_from(["wrong", "short", "long", "bools"]))
        if choice == "wrong":
            step.logprobs = draw(st.sampled_from(BAD_REAL_LISTS))
        elif choice == "short":
            step.logprobs = list(step.logprobs)[:-1]
        elif choice == "long":
            step.logprobs = [*step.logprobs, -0.5]
        else:
            step.logprobs = np.zeros(len(step.logprobs), dtype=bool)
        return trajectory, advantage, "logprobs"
    if kind == "missing":
        name = draw(st.sampled_from(["prompt_ids", "response_ids", "logprobs"]))
        steps[index] = SimpleNamespace(**{k: v for k, v in vars(step).items() if k != name})
        return trajectory, advantage, name
    if kind == "none step":
        steps[index] = None
        return trajectory, advantage, "prompt_ids"
    if kind == "metadata":
        step.metadata = draw(st.sampled_from(BAD_METADATA))
        return trajectory, advantage, "metadata"
    if kind == "reward":
        if draw(st.booleans()):
            trajectory.reward = draw(st.sampled_from(BAD_SCALARS))
        else:
            trajectory.reward = None
            steps[-1].reward = draw(st.sampled_from([*BAD_SCALARS, None]))
        return trajectory, advantage, "reward"
    if kind == "steps":
        trajectory.steps = draw(st.sampled_from(BAD_STEPS))
        return trajectory, advantage, "steps"
    if kind == "name":
        trajectory.name = draw(st.sampled_from(BAD_NAMES))
        return trajectory, advantage, "name"
    if kind == "advantage":
        return trajectory, draw(st.sampled_from([*BAD_SCALARS, None])), "advantage"
    # "sequence": a response long enough to overflow max_seq_len, otherwise well-formed
    extra = CONFIG.max_seq_len + 1
    step.response_ids = list(step.response_ids) + [2] * extra
    step.logprobs = list(step.logprobs) + [-1.0] * extra
    return trajectory, advantage, "sequence"


@dataclass
class Planned:
    """A group as generated: which trajectories were corrupted (and how), or a corrupted group."""

    group: SimpleNamespace
    advantages: list
    bad_fields: list[str | None]  # per trajectory: the corrupted field, None when valid
    group_field: str | None = None  # "group_id" / "trajectories" when the group itself is bad

    def drops(self) -> Counter:
        if self.group_field == "trajectories":
            return Counter({"trajectories": 1})
        if self.group_field == "group_id":
            return Counter({"group_id": len(self.bad_fields)})
        return Counter(field for field in self.bad_fields if field is not None)

    def clean(self) -> tuple[SimpleNamespace, list] | None:
        """The group with only its valid trajectories (and their metadata), as if alone."""
        if self.group_field is not None:
            return None
        keep = [i for i, field in enumerate(self.bad_fields) if field is None]
        if not keep:
            return None
        group = SimpleNamespace(
            trajectories=[self.group.trajectories[i] for i in keep],
            group_id=self.group.group_id,
            metadata=[self.group.metadata[i] for i in keep],
        )
        return group, [self.advantages[i] for i in keep]


@st.composite
def planned_group(draw: Any, g: int) -> Planned:
    size = draw(st.integers(1, 4))
    trajectories, advantages, fields = [], [], []
    for _ in range(size):
        trajectory, advantage = draw(valid_trajectory()), draw(st.floats(-3, 3))
        field = None
        if draw(st.integers(0, 9)) < 6:
            trajectory, advantage, field = draw(corrupt(trajectory, advantage))
        trajectories.append(trajectory)
        advantages.append(advantage)
        fields.append(field)
    metadata = [{"task_id": f"t{g}", "rollout_idx": i} for i in range(size)]
    group = SimpleNamespace(trajectories=trajectories, group_id=f"t{g}:solver", metadata=metadata)
    plan = Planned(group, advantages, fields)
    which = draw(st.integers(0, 19))
    if which == 0:
        group.group_id, plan.group_field = draw(st.sampled_from(BAD_GROUP_IDS)), "group_id"
    elif which == 1:
        group.trajectories, plan.group_field = draw(st.sampled_from(BAD_TRAJECTORY_LISTS)), "trajectories"
        plan.advantages = []
    return plan


@st.composite
def campaign_batch(draw: Any) -> list[Planned]:
    return [draw(planned_group(g)) for g in range(draw(st.integers(1, 8)))]


# ---------------------------------------------------------------------------------------- checks


def assert_same_batch(left, right) -> None:
    assert sorted(left.keys()) == sorted(right.keys())
    for key in left.keys():
        assert left[key].dtype == right[key].dtype and torch.equal(left[key], right[key]), key
    assert left.metadata == right.metadata


def check_alone(plan: Planned, t: int | None) -> None:
    """One corrupted trajectory (or the corrupted group) converted on its own names its field."""
    if t is None:
        group, advantages, expected = plan.group, [plan.advantages], plan.group_field
    else:
        group = SimpleNamespace(
            trajectories=[plan.group.trajectories[t]],
            group_id=plan.group.group_id,
            metadata=[plan.group.metadata[t]],
        )
        advantages, expected = [[plan.advantages[t]]], plan.bad_fields[t]
    with pytest.raises(MalformedTrajectoryError) as err:
        trajectory_groups_to_batch([group], CONFIG, advantages)
    assert err.value.field_name == expected, str(err.value)
    if plan.group_field == "trajectories":
        assert str(err.value).startswith(f"group #0 {plan.group.group_id!r}, trajectories: ")
    else:
        label = f"episode '{group.metadata[0]['task_id']}:{group.metadata[0]['rollout_idx']}' (role "
        assert str(err.value).startswith(label), str(err.value)


def run_campaign(batch: list[Planned], totals: Counter) -> None:
    groups = [plan.group for plan in batch]
    advantages = [plan.advantages for plan in batch]
    expected = sum((plan.drops() for plan in batch), Counter())
    # Without dropping: the first malformed trajectory raises, and nothing but our error escapes.
    if expected:
        with pytest.raises(MalformedTrajectoryError):
            trajectory_groups_to_batch(groups, CONFIG, advantages)
    for plan in batch:
        if plan.group_field is not None:
            check_alone(plan, None)
        else:
            for t, field in enumerate(plan.bad_fields):
                if field is not None:
                    check_alone(plan, t)
    # Dropping: exactly the batch of the valid trajectories, every drop counted under its field.
    clean = [c for c in (plan.clean() for plan in batch) if c is not None]
    drop_config = replace(CONFIG, drop_malformed=True)
    if not clean:
        with pytest.raises(EmptyBatchError):
            trajectory_groups_to_batch(groups, drop_config, advantages)
    else:
        got, stats = trajectory_groups_to_batch(groups, drop_config, advantages)
        want, want_stats = trajectory_groups_to_batch([g for g, _ in clean], CONFIG, [a for _, a in clean])
        assert_same_batch(got, want)
        assert stats.dropped_malformed == sum(expected.values())
        assert Counter(stats.drop_fields) == expected
        assert replace(stats, dropped_malformed=0, drop_reasons=(), drop_fields=()) == want_stats
        totals["valid trajectories"] += sum(len(g.trajectories) for g, _ in clean)
    totals.update({f"malformed: {field}": n for field, n in expected.items()})
    totals["malformed"] += sum(expected.values())
    totals["batches"] += 1


def test_generated_malformed_episodes_are_named_dropped_and_counted():
    totals: Counter = Counter()

    @settings(
        max_examples=200,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(batch=campaign_batch())
    def campaign(batch: list[Planned]) -> None:
        run_campaign(batch, totals)

    campaign()
    print("\ncampaign:", dict(sorted(totals.items())))
    assert totals["malformed"] >= MIN_MALFORMED, totals
    fields = {key.removeprefix("malformed: ") for key in totals if key.startswith("malformed: ")}
    assert fields >= {"prompt_ids", "response_ids", "logprobs", "metadata", "reward", "steps", "name"}
    assert fields >= {"advantage", "sequence", "group_id", "trajectories"}
