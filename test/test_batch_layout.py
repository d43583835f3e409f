"""``build_rows`` lays rows out bit for bit as SkyRL's own ``convert_prompts_responses_to_batch_tensors``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

from rllm_skyrl.data.batch_layout import RowSpec, Span, build_rows, right_aligned

ids = st.lists(st.integers(0, 2**40), min_size=1, max_size=9)
reals = st.floats(-1e6, 1e6, allow_subnormal=True, width=64)


@st.composite
def row(draw) -> tuple[RowSpec, list[tuple[list[int], bool, list[float], list[float]]]]:
    """A prompt, then pieces alternating freely between context (observations) and sampled tokens:
    the row as ``build_rows`` takes it, and its response window per token (ids, trained, logprobs,
    advantages) as the lists SkyRL's builder takes."""
    pieces, spans, column = [], [], 0
    for trained in draw(st.lists(st.booleans(), min_size=1, max_size=5)) + [True]:
        tokens = draw(ids)
        n = len(tokens)
        if not trained:
            pieces.append((tokens, False, [0.0] * n, [0.0] * n))
        else:
            logprobs = draw(st.lists(reals, min_size=n, max_size=n))
            per_token = draw(st.lists(reals, min_size=n, max_size=n)) if draw(st.booleans()) else None
            advantage = per_token if per_token is not None else draw(reals)
            pieces.append((tokens, True, logprobs, per_token if per_token is not None else [advantage] * n))
            spans.append(Span(column, n, np.array(logprobs), np.array(advantage) if per_token else advantage))
        column += n
    prompt_ids = draw(ids)
    tokens = np.array(prompt_ids + [t for piece in pieces for t in piece[0]], dtype=np.int64)
    return RowSpec(tokens, len(prompt_ids), spans, draw(reals)), pieces


def window(pieces: list, field: int) -> list:
    return [
        value
        for piece in pieces
        for value in (piece[field] if field != 1 else [int(piece[1])] * len(piece[0]))
    ]


@settings(max_examples=60, deadline=None)
@given(drawn=st.lists(row(), min_size=1, max_size=6), pad=st.integers(0, 5))
def test_rows_match_skyrls_builder_bit_for_bit(drawn, pad):
    rows = [spec for spec, _ in drawn]
    got = build_rows(pad, rows, logprobs=True, advantages=True)
    responses = [window(pieces, 0) for _, pieces in drawn]
    rewards = [[0.0] * (len(resp) - 1) + [r.reward] for r, resp in zip(rows, responses, strict=True)]
    expected = convert_prompts_responses_to_batch_tensors(
        pad,
        [r.tokens[: r.prompt_length].tolist() for r in rows],
        responses,
        rewards,
        [window(pieces, 1) for _, pieces in drawn],
        [window(pieces, 2) for _, pieces in drawn],
    )
    names = ["sequences", "attention_mask", "response_mask", "rewards", "loss_mask", "rollout_logprobs"]
    for name, tensor in zip(names, expected[:6], strict=True):
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    advantages = right_aligned([window(pieces, 3) for _, pieces in drawn], got["response_mask"].shape[1])
    assert torch.equal(got["advantages"], advantages)


def test_optional_fields_are_left_out():
    spec = RowSpec(np.array([1, 2, 3]), 2, [Span(0, 1)])
    got = build_rows(0, [spec], logprobs=False, advantages=False)
    assert sorted(got) == ["attention_mask", "loss_mask", "response_mask", "rewards", "sequences"]


def test_right_aligned_puts_each_row_at_the_end_of_its_line():
    rows = [[1.0, 2.0], [], [3.0, 4.0, 5.0], np.array([6.5], dtype=np.float32)]
    got = right_aligned(rows, 3)
    assert got.dtype == torch.float32
    assert got.tolist() == [[0.0, 1.0, 2.0], [0.0, 0.0, 0.0], [3.0, 4.0, 5.0], [0.0, 0.0, 6.5]]
    with pytest.raises(ValueError, match="row 1 has 4 values, more than the width 3"):
        right_aligned([[1.0], [1.0, 2.0, 3.0, 4.0]], 3)
