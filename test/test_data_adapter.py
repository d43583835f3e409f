"""Trajectory groups -> TrainingInputBatch: layout, merging, padding, validation."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers import Step, Trajectory, TrajectoryGroup, group_of
from hypothesis import given, settings
from hypothesis import strategies as st
from skyrl.backends.skyrl_train.workers.worker_utils import BaseBatchIterator
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

from rllm_skyrl.data import step_reads
from rllm_skyrl.data.adapter import (
    BatchConfig,
    EmptyBatchError,
    sft_examples_to_batch,
    trajectory_groups_to_batch,
)
from rllm_skyrl.data.batch_layout import PAD_ROW_ID
from rllm_skyrl.data.trajectory_checks import MalformedTrajectoryError

PAD = 0
HYPOTHESIS = settings(max_examples=40, deadline=None)


def real_tokens(batch, row: int) -> list[int]:
    return batch["sequences"][row][batch["attention_mask"][row].bool()].tolist()


def response_window(batch, key: str, row: int) -> list[float]:
    """The real response part of a right-aligned response-level tensor."""
    return batch[key][row][batch["response_mask"][row].bool()].tolist()


tokens = st.lists(st.integers(1, 400), min_size=1, max_size=12)


@HYPOTHESIS
@given(
    pairs=st.lists(st.tuples(tokens, tokens), min_size=1, max_size=6),
    advantages=st.lists(st.floats(-3, 3), min_size=6, max_size=6),
)
def test_single_turn_rows_match_skyrl_builder(pairs, advantages):
    groups = [
        group_of(Trajectory([Step(p, r)], reward=float(i)), task=f"t{i}") for i, (p, r) in enumerate(pairs)
    ]
    batch, stats = trajectory_groups_to_batch(
        groups, BatchConfig(pad_token_id=PAD), [[advantages[i]] for i in range(len(pairs))]
    )
    prompts, responses = [p for p, _ in pairs], [r for _, r in pairs]
    logprobs = [g.trajectories[0].steps[0].logprobs for g in groups]
    rewards = [[0.0] * (len(r) - 1) + [float(i)] for i, r in enumerate(responses)]
    expected = convert_prompts_responses_to_batch_tensors(
        PAD, prompts, responses, rewards, [[1] * len(r) for r in responses], logprobs
    )
    for key, tensor in zip(
        ["sequences", "attention_mask", "response_mask", "rewards", "loss_mask", "rollout_logprobs"],
        expected[:6],
        strict=True,
    ):
        assert torch.equal(batch[key], tensor), key
    assert torch.equal(batch["action_log_probs"], batch["rollout_logprobs"])
    assert batch.metadata["response_length"] == batch["response_mask"].shape[1]
    for i, response in enumerate(responses):
        assert response_window(batch, "advantages", i) == pytest.approx([advantages[i]] * len(response))
        assert batch["advantages"][i][~batch["response_mask"][i].bool()].abs().sum() == 0
    assert stats.num_rows == len(pairs) and stats.merge_compression_ratio == 1.0


@st.composite
def multi_turn(draw):
    """A conversation whose every prompt is the previous prompt + response + new observation tokens."""
    prompt = draw(tokens)
    steps, expected_mask, sequence = [], [], list(prompt)
    for turn in range(draw(st.integers(1, 5))):
        observation = draw(tokens) if turn else []
        response = draw(tokens)
        steps.append(Step(sequence + observation, response))
        sequence = sequence + observation + response
        expected_mask += [0] * len(observation) + [1] * len(response)
    return prompt, steps, sequence, expected_mask


@HYPOTHESIS
@given(conversation=multi_turn(), advantage=st.floats(-2, 2), reward=st.floats(-1, 1))
def test_extending_steps_merge_into_one_row(conversation, advantage, reward):
    prompt, steps, sequence, expected_mask = conversation
    group = group_of(Trajectory(steps, reward=reward))
    batch, stats = trajectory_groups_to_batch([group], BatchConfig(pad_token_id=PAD), [[advantage]])

    assert batch.batch_size == 1
    assert real_tokens(batch, 0) == sequence
    assert response_window(batch, "loss_mask", 0) == expected_mask
    model_tokens = batch["loss_mask"][0].bool()
    sampled_logprobs = [lp for step in steps for lp in step.logprobs]
    assert batch["rollout_logprobs"][0][model_tokens].tolist() == pytest.approx(sampled_logprobs)
    assert batch["rollout_logprobs"][0][~model_tokens].abs().sum() == 0
    assert batch["advantages"][0][model_tokens].tolist() == pytest.approx([advantage] * sum(expected_mask))
    assert batch["advantages"][0][~model_tokens].abs().sum() == 0
    assert batch["rewards"][0].tolist() == pytest.approx([0.0] * (batch["rewards"].shape[1] - 1) + [reward])
    assert batch["response_mask"][0].sum() == len(sequence) - len(prompt)
    assert stats.merge_compression_ratio == len(steps)
    assert stats.action_token_ratios[0] == pytest.approx(sum(expected_mask) / len(expected_mask))
    span = "step 0" if len(steps) == 1 else f"steps 0-{len(steps) - 1}"
    assert batch.metadata["row_ids"] == [f"episode 'task-3:0' (role 'solver') {span}"]


@HYPOTHESIS
@given(st.lists(st.tuples(st.booleans(), tokens, tokens), min_size=1, max_size=6))
def test_steps_that_do_not_extend_start_new_rows(plan):
    steps, expected_rows, sequence = [], [], []
    for index, (extends, new_tokens, response) in enumerate(plan):
        if extends and sequence:
            prompt = sequence + new_tokens
            expected_rows[-1] += new_tokens + response
        else:
            prompt = [1000 + index] + new_tokens  # a fresh context: cannot start with the previous row
            expected_rows.append(prompt + response)
        steps.append(Step(prompt, response))
        sequence = prompt + response
    batch, stats = trajectory_groups_to_batch([group_of(Trajectory(steps))], BatchConfig(pad_token_id=PAD))
    assert batch.batch_size == len(expected_rows)
    assert [real_tokens(batch, i) for i in range(len(expected_rows))] == expected_rows
    assert stats.rows_per_traj == (len(expected_rows),)
    assert stats.merge_compression_ratio == pytest.approx(len(steps) / len(expected_rows))
    assert "advantages" not in batch  # no advantages given: GAE fills them later


@HYPOTHESIS
@given(num_trajectories=st.integers(1, 7), dp_size=st.integers(1, 4))
def test_batch_is_padded_to_dp_multiple_with_inert_rows(num_trajectories, dp_size):
    trajectories = [
        Trajectory([Step([1, 2 + i], [3] * (i + 1))], uid=f"u{i}") for i in range(num_trajectories)
    ]
    batch, stats = trajectory_groups_to_batch(
        [group_of(*trajectories)], BatchConfig(pad_token_id=PAD, dp_size=dp_size), [[1.0] * num_trajectories]
    )
    pad = (-num_trajectories) % dp_size
    assert batch.batch_size % dp_size == 0 and batch.batch_size == num_trajectories + pad
    assert batch.metadata["pad_size"] == pad == stats.num_pad_rows
    assert batch["loss_mask"][num_trajectories:].sum() == 0
    assert batch.metadata["row_ids"][num_trajectories:] == [PAD_ROW_ID] * pad
    assert len(batch.metadata["uids"]) == batch.batch_size
    # What Ray ships to the workers, and what the worker turns each micro-batch into.
    shipped = pickle.loads(pickle.dumps(batch))
    experience = BaseBatchIterator.batch_to_experience(shipped)
    assert experience.num_actions == batch["response_mask"].shape[1]
    assert torch.equal(experience.advantages, batch["advantages"])


def test_lineages_merge_independently():
    parent = [Step([1, 2], [3]), Step([1, 2, 3, 4], [5])]
    child = [Step([9], [8]), Step([9, 8, 7], [6])]
    for step in parent:
        step.metadata["lineage_id"] = "parent"
    for step in child:
        step.metadata["lineage_id"] = "child"
    steps = [parent[0], child[0], parent[1], child[1]]  # interleaved in time
    batch, stats = trajectory_groups_to_batch([group_of(Trajectory(steps))], BatchConfig(pad_token_id=PAD))
    assert [real_tokens(batch, i) for i in range(2)] == [[1, 2, 3, 4, 5], [9, 8, 7, 6]]
    assert batch.metadata["row_ids"][0].endswith("steps 0-2")
    assert stats.merge_compression_ratio == 2.0


def test_precomputed_per_token_advantages_follow_their_tokens():
    steps = [
        Step([1], [2, 3], reward=None, advantage=[0.5, -0.5]),
        Step([1, 2, 3, 4], [5], reward=None, advantage=2.0),
    ]
    config = BatchConfig(pad_token_id=PAD, use_precomputed_advantages=True)
    batch, _ = trajectory_groups_to_batch([group_of(Trajectory(steps, reward=None))], config)
    assert response_window(batch, "advantages", 0) == [0.5, -0.5, 0.0, 2.0]
    assert batch["rewards"][0, -1] == 0.0  # no reward needed when advantages come with the steps
    with pytest.raises(ValueError, match="not both"):
        trajectory_groups_to_batch([group_of(Trajectory(steps))], config, [[1.0]])


def test_reward_falls_back_to_last_step_reward():
    trajectory = Trajectory([Step([1], [2], reward=0.0), Step([7], [8], reward=0.75)], reward=None)
    batch, _ = trajectory_groups_to_batch([group_of(trajectory)], BatchConfig(pad_token_id=PAD), [[1.0]])
    assert batch["rewards"][:, -1].tolist() == [0.75, 0.75]


def test_metrics_use_rllm_names():
    group = group_of(Trajectory([Step([1], [2, 3]), Step([1, 2, 3, 4], [5])]), Trajectory([Step([1], [2])]))
    _, stats = trajectory_groups_to_batch([group], BatchConfig(pad_token_id=PAD, dp_size=4))
    metrics = stats.metrics()
    assert metrics["batch/merge_compression_ratio"] == 1.5
    assert metrics["batch/steps_per_traj/max"] == 2.0
    assert metrics["batch/step_response_length/mean"] == 2.5
    assert metrics["batch/action_token_ratio/min"] == 0.75
    assert metrics["batch/dropped_malformed_sequences"] == 0.0
    assert metrics["batch/num_pad_rows"] == 2.0


def bad(reward: float | None = 1.0, name: str = "solver", **last_step: Any) -> Trajectory:
    """A three-step trajectory with the given reward and role whose step 2 carries ``last_step``."""
    last = {"prompt_ids": [1, 2, 3, 4, 5, 6], "response_ids": [7] * 18} | last_step
    steps = [Step([1, 2], [3]), Step([1, 2, 3, 4], [5]), Step(**last)]
    return Trajectory(steps, reward=reward, name=name, uid="u-bad")


def GOOD() -> Trajectory:  # noqa: N802 - reads as a constant in the tables below
    return Trajectory([Step([1], [2], advantage=1.0)], uid="u-good")


MALFORMED = [
    (
        bad(logprobs=[-0.1] * 17),
        BatchConfig(pad_token_id=PAD),
        "episode 'task-3:1' (role 'solver') step 2, logprobs: 17 values for 18 response tokens; "
        "the rollout engine must return one log p <= 0 per sampled token",
        "logprobs",
    ),
    (
        bad(logprobs=[-0.1] * 17 + [math.nan]),
        BatchConfig(pad_token_id=PAD),
        "step 2, logprobs: element 17 is nan",
        "logprobs",
    ),
    (
        bad(response_ids=[], logprobs=[]),
        BatchConfig(pad_token_id=PAD),
        "step 2, response_ids: empty response",
        "response_ids",
    ),
    (bad(reward=math.nan), BatchConfig(pad_token_id=PAD), "(role 'solver'), reward: is nan", "reward"),
    (bad(reward=math.inf), BatchConfig(pad_token_id=PAD), "reward: is inf; the reward function", "reward"),
    (
        Trajectory([Step([1], [2], reward=None)], reward=None, uid="u-bad"),
        BatchConfig(pad_token_id=PAD),
        "reward: no reward on the trajectory or its last step; set Trajectory.reward",
        "reward",
    ),
    (
        bad(),
        BatchConfig(pad_token_id=PAD, max_seq_len=20),
        "step 2, sequence: the row built from steps 0-2 has 24 tokens, more than max_seq_len=20; "
        "raise max_seq_len",
        "sequence",
    ),
    (
        bad(name="judge"),
        BatchConfig(pad_token_id=PAD, allowed_roles={"solver"}),
        "(role 'judge'), name: unknown role 'judge' (configured roles: ['solver']); name the trajectory",
        "name",
    ),
    (
        bad(response_ids=[7] * 17 + [600]),
        BatchConfig(pad_token_id=PAD, vocab_size=512),
        "step 2, response_ids: token id 600 at position 17 is outside the vocabulary [0, 512)",
        "response_ids",
    ),
    (
        Trajectory([], uid="u-bad"),
        BatchConfig(pad_token_id=PAD),
        "(role 'solver'), steps: no steps; a trajectory needs a model call",
        "steps",
    ),
    (
        Trajectory([Step([], [1])], uid="u-bad"),
        BatchConfig(pad_token_id=PAD),
        "step 0, prompt_ids: empty prompt",
        "prompt_ids",
    ),
    (
        bad(advantage=[1.0] * 3),
        BatchConfig(pad_token_id=PAD, use_precomputed_advantages=True),
        "step 0, advantage: step.advantage is None",  # steps 0 and 1 carry none
        "advantage",
    ),
]


@pytest.mark.parametrize(("trajectory", "config", "message", "field_name"), MALFORMED)
def test_malformed_trajectory_errors_name_the_item(trajectory, config, message, field_name):
    group = group_of(GOOD(), trajectory)
    with pytest.raises(MalformedTrajectoryError) as err:
        trajectory_groups_to_batch([group], config)
    assert message in str(err.value)
    assert "episode 'task-3:1'" in str(err.value)
    assert err.value.field_name == field_name


@pytest.mark.parametrize(("trajectory", "config", "message", "field_name"), MALFORMED)
def test_drop_malformed_counts_and_keeps_the_rest(trajectory, config, message, field_name):
    group = group_of(GOOD(), trajectory)
    drop_config = replace(config, drop_malformed=True)
    batch, stats = trajectory_groups_to_batch([group], drop_config)
    assert batch.batch_size == 1 and real_tokens(batch, 0) == [1, 2]
    assert stats.dropped_malformed == 1 and message in stats.drop_reasons[0]
    assert stats.metrics()["batch/dropped_malformed_sequences"] == 1.0


def multi_turn(first: int) -> Trajectory:
    """Two merging steps whose ids start at ``first``: each good trajectory's tokens are its own."""
    prompt, response = [first, first + 1], [first + 2, first + 3]
    steps = [
        Step(prompt, response, [-0.5, -0.25], advantage=1.0),
        Step(prompt + response + [first + 4], [first + 5], [-0.125], advantage=1.0),
    ]
    return Trajectory(steps, reward=1.0, uid=f"u-{first}")


@pytest.mark.parametrize("chunk_ids", [1, 12, step_reads.CHUNK_IDS])
@pytest.mark.parametrize(("trajectory", "config", "message", "field_name"), MALFORMED)
def test_a_dropped_trajectory_between_good_ones_leaves_their_rows_as_they_were(
    trajectory, config, message, field_name, chunk_ids, monkeypatch
):
    """Ids are read and checked a chunk of trajectories at a time: a bad trajectory's reads are
    undone, or its chunk's check fails and each of the chunk's trajectories is checked alone; the
    rows after it must come out exactly as they do without it, whatever the chunks hold."""
    monkeypatch.setattr(step_reads, "CHUNK_IDS", chunk_ids)
    drop_config = replace(config, drop_malformed=True)
    goods = [multi_turn(10), multi_turn(40), multi_turn(70)]
    alone, _ = trajectory_groups_to_batch([group_of(*goods)], drop_config)
    mixed, stats = trajectory_groups_to_batch(
        [group_of(goods[0], trajectory, goods[1]), group_of(trajectory, goods[2], task="task-4")],
        drop_config,
    )
    assert stats.drop_fields == (field_name, field_name) and message in stats.drop_reasons[0]
    for key in ("sequences", "attention_mask", "loss_mask", "rollout_logprobs", "rewards"):
        assert torch.equal(mixed[key], alone[key]), key


def long_conversation(seed: int) -> Trajectory:
    """Two merging turns, 1,600 ids read: a batch of 200 spans several of the reads' chunks."""
    prompt = [2 + (seed * 7 + i) % 500 for i in range(400)]
    response = [2 + (seed + i) % 500 for i in range(300)]
    steps = [Step(prompt, response), Step(prompt + response + [3, 4], [5] * 200)]
    return Trajectory(steps, reward=float(seed % 2), uid=f"u-{seed}")


DEEP = [
    ("response_ids", 123, True, "response_ids: element 123 is True (a bool); token ids must be integers"),
    ("prompt_ids", 650, -5, "prompt_ids: token id -5 at position 650 is outside the vocabulary [0, 512)"),
    ("prompt_ids", 701, 2.0, "prompt_ids: element 701 is 2.0; token ids must be integers"),
    ("logprobs", 77, math.nan, "logprobs: element 77 is nan; the rollout engine must return"),
    ("logprobs", 199, 0.5, "logprobs: element 199 is 0.5, above 0.0001; the rollout engine must return"),
]


@pytest.mark.parametrize(("name", "position", "value", "message"), DEEP)
def test_a_malformed_element_deep_in_a_large_batch_is_named_exactly(name, position, value, message):
    """The batch is read and checked a chunk at a time; one bad element among 320,000 ids is still
    named by episode, step, field and position, and dropping its trajectory leaves every other row
    exactly as the batch without it has it."""
    groups = [
        group_of(*(long_conversation(8 * g + t) for t in range(8)), task=f"task-{g}") for g in range(25)
    ]
    steps = [step for group in groups for trajectory in group.trajectories for step in trajectory.steps]
    assert sum(len(step.prompt_ids) + len(step.response_ids) for step in steps) > 2 * step_reads.CHUNK_IDS
    config = BatchConfig(pad_token_id=PAD, vocab_size=512)
    clean, _ = trajectory_groups_to_batch(groups, config)
    getattr(groups[17].trajectories[5].steps[1], name)[position] = value
    with pytest.raises(MalformedTrajectoryError) as err:
        trajectory_groups_to_batch(groups, config)
    assert str(err.value).startswith(f"episode 'task-17:5' (role 'solver') step 1, {message}")
    dropped, stats = trajectory_groups_to_batch(groups, replace(config, drop_malformed=True))
    assert stats.dropped_malformed == 1 and stats.drop_fields == (name,)
    kept = [i for i in range(clean.batch_size) if i != 17 * 8 + 5]
    for key in clean.keys():
        assert torch.equal(dropped[key][: len(kept)], clean[key][kept]), key
    assert dropped.metadata["row_ids"][: len(kept)] == [clean.metadata["row_ids"][i] for i in kept]


def test_advantage_length_mismatch_names_the_step():
    trajectory = Trajectory([Step([1], [2, 3], advantage=[1.0])])
    config = BatchConfig(pad_token_id=PAD, use_precomputed_advantages=True)
    with pytest.raises(MalformedTrajectoryError, match="step 0, advantage: 1 values for 2 response tokens"):
        trajectory_groups_to_batch([group_of(trajectory)], config)


def test_nonfinite_trajectory_advantage_is_rejected():
    with pytest.raises(MalformedTrajectoryError, match="advantage: is nan"):
        trajectory_groups_to_batch([group_of(Trajectory([Step([1], [2])]))], BatchConfig(PAD), [[math.nan]])


def test_everything_dropped_raises_a_skippable_error():
    config = BatchConfig(pad_token_id=PAD, drop_malformed=True)
    with pytest.raises(
        EmptyBatchError, match="1 trajectories dropped as malformed .first: episode 'task-3:0'"
    ):
        trajectory_groups_to_batch([group_of(bad(reward=math.nan))], config)


def test_misaligned_advantages_are_rejected():
    group = group_of(Trajectory([Step([1], [2])]), Trajectory([Step([1], [3])]))
    with pytest.raises(ValueError, match="1 advantages for 2 trajectories"):
        trajectory_groups_to_batch([group], BatchConfig(PAD), [[1.0]])
    with pytest.raises(ValueError, match="2 entries for 1 groups"):
        trajectory_groups_to_batch([group], BatchConfig(PAD), [[1.0, 1.0], [1.0]])


def test_label_falls_back_to_trajectory_uid():
    group = TrajectoryGroup([Trajectory([Step([1], [2], logprobs=[])], uid="abc")], "task:solver")
    message = "trajectory 'abc' .role 'solver'. step 0, logprobs: 0 values"
    with pytest.raises(MalformedTrajectoryError, match=message):
        trajectory_groups_to_batch([group], BatchConfig(PAD))


@HYPOTHESIS
@given(pairs=st.lists(st.tuples(tokens, tokens), min_size=1, max_size=5), dp_size=st.integers(1, 3))
def test_sft_rows_train_on_responses_only(pairs, dp_size):
    batch = sft_examples_to_batch(pairs, pad_token_id=PAD, dp_size=dp_size)
    prompts, responses = [p for p, _ in pairs], [r for _, r in pairs]
    expected = convert_prompts_responses_to_batch_tensors(
        PAD, prompts, responses, [[0.0] * len(r) for r in responses], [[1] * len(r) for r in responses]
    )
    n = len(pairs)
    assert torch.equal(batch["sequences"][:n], expected[0])
    assert torch.equal(batch["response_mask"][:n], expected[2])
    total = sum(len(r) for r in responses)
    assert torch.allclose(batch["loss_mask"][:n], expected[4] / total)  # summed loss = per-token mean
    assert batch["loss_mask"][n:].sum() == 0 and batch.batch_size % dp_size == 0
    assert batch.get("advantages") is None and batch.get("action_log_probs") is None
    summed = sft_examples_to_batch(pairs, pad_token_id=PAD, loss_reduction="sum")
    assert torch.equal(summed["loss_mask"], expected[4])


def test_sft_errors_name_the_example():
    with pytest.raises(MalformedTrajectoryError, match="SFT example 1, response_ids: empty response_ids"):
        sft_examples_to_batch([([1], [2]), ([1], [])], pad_token_id=PAD)
    with pytest.raises(MalformedTrajectoryError, match="SFT example 0, sequence: 3 tokens, more"):
        sft_examples_to_batch([([1], [2, 3])], pad_token_id=PAD, max_seq_len=2)
    with pytest.raises(MalformedTrajectoryError, match="SFT example 0, response_ids: token id 9 "):
        sft_examples_to_batch([([1], [9])], pad_token_id=PAD, vocab_size=5)
    with pytest.raises(ValueError, match="'token_mean' or 'sum'"):
        sft_examples_to_batch([([1], [2])], pad_token_id=PAD, loss_reduction="mean")
