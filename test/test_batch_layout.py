"""``build_rows`` lays rows out bit for bit as SkyRL's own ``convert_prompts_responses_to_batch_tensors``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

from rllm_skyrl.batch_layout import Piece, RowSpec, build_rows, right_aligned

ids = st.lists(st.integers(0, 2**40), min_size=1, max_size=9)
reals = st.floats(-1e6, 1e6, allow_subnormal=True, width=64)


@st.composite
def row(draw):
    """A prompt, then pieces alternating freely between context (observations) and sampled tokens;
    the row's tokens end to end given or left to ``build_rows`` to gather."""
    pieces = []
    for trained in draw(st.lists(st.booleans(), min_size=1, max_size=5)) + [True]:
        tokens = draw(ids)
        if not trained:
            pieces.append(Piece(np.array(tokens, dtype=np.int64), trained=False))
            continue
        logprobs = np.array(draw(st.lists(reals, min_size=len(tokens), max_size=len(tokens))))
        per_token = draw(st.booleans())
        advantages = np.array(draw(st.lists(reals, min_size=len(tokens), max_size=len(tokens))))
        pieces.append(
            Piece(np.array(tokens, dtype=np.int64), True, logprobs, advantages if per_token else draw(reals))
        )
    prompt_ids = np.array(draw(ids), dtype=np.int64)
    tokens = np.concatenate([prompt_ids, *(piece.ids for piece in pieces)]) if draw(st.booleans()) else None
    return RowSpec(prompt_ids, pieces, draw(reals), tokens)


def flat(row_spec: RowSpec, field: str) -> list:
    """A row's response-window field as the per-token Python list SkyRL's builder takes."""
    out: list = []
    for piece in row_spec.pieces:
        n = len(piece.ids)
        if field == "ids":
            out += piece.ids.tolist()
        elif field == "mask":
            out += [int(piece.trained)] * n
        elif not piece.trained:
            out += [0.0] * n
        else:
            value = getattr(piece, field)
            out += np.broadcast_to(value, (n,)).tolist()
    return out


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(row(), min_size=1, max_size=6), pad=st.integers(0, 5))
def test_rows_match_skyrls_builder_bit_for_bit(rows, pad):
    got = build_rows(pad, rows, logprobs=True, advantages=True)
    responses = [flat(r, "ids") for r in rows]
    rewards = [[0.0] * (len(resp) - 1) + [r.reward] for r, resp in zip(rows, responses, strict=True)]
    expected = convert_prompts_responses_to_batch_tensors(
        pad,
        [r.prompt_ids.tolist() for r in rows],
        responses,
        rewards,
        [flat(r, "mask") for r in rows],
        [flat(r, "logprobs") for r in rows],
    )
    names = ["sequences", "attention_mask", "response_mask", "rewards", "loss_mask", "rollout_logprobs"]
    for name, tensor in zip(names, expected[:6], strict=True):
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    advantages = right_aligned([flat(r, "advantages") for r in rows], got["response_mask"].shape[1])
    assert torch.equal(got["advantages"], advantages)


def test_optional_fields_are_left_out():
    spec = RowSpec(np.array([1, 2]), [Piece(np.array([3]), trained=True)])
    got = build_rows(0, [spec], logprobs=False, advantages=False)
    assert sorted(got) == ["attention_mask", "loss_mask", "response_mask", "rewards", "sequences"]


def test_right_aligned_puts_each_row_at_the_end_of_its_line():
    rows = [[1.0, 2.0], [], [3.0, 4.0, 5.0], np.array([6.5], dtype=np.float32)]
    got = right_aligned(rows, 3)
    assert got.dtype == torch.float32
    assert got.tolist() == [[0.0, 1.0, 2.0], [0.0, 0.0, 0.0], [3.0, 4.0, 5.0], [0.0, 0.0, 6.5]]
    with pytest.raises(ValueError, match="row 1 has 4 values, more than the width 3"):
        right_aligned([[1.0], [1.0, 2.0, 3.0, 4.0]], 3)
