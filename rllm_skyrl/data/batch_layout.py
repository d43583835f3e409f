"""SkyRL's ``TrainingInputBatch`` layout, written once: right-aligned responses, DP padding, row slices.

SkyRL's rows (``skyrl/train/dataset/preprocess.py``) are ``[PAD | prompt | response]`` with
response-level tensors ``[B, response_len]`` right-aligned: a row's response is its *last* ``n``
positions. Every data-parallel rank must get as many rows, so batches are padded with SkyRL's
``pad_training_input_batch`` (copies of row 0, ``loss_mask`` 0). ``metadata`` keys kept consistent:

    uids             group id per row (SkyRL's prompt identity); pad rows get SkyRL's ``pad<i>``
    row_ids          who a row came from, for error messages; pad rows get ``PAD_ROW_ID``
    response_length  width of the response-level tensors
    pad_size         how many trailing rows are DP padding
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch, pad_training_input_batch

PAD_ROW_ID = "<pad>"


class Span(NamedTuple):
    """Sampled tokens of a row's response window, from ``column`` (0: the window's first token).

    ``advantages`` is one value per token or one for all. The window's other tokens are context
    (observations between turns): ``loss_mask``, logprob and advantage 0."""

    column: int
    length: int
    logprobs: np.ndarray | None = None
    advantages: np.ndarray | float | None = None


class RowSpec(NamedTuple):
    """One row: ids (prompt, then response window), the window's trained spans, and the outcome
    reward on its last token. The ids are one array (a merged multi-turn row is a run of the buffer
    its ids were read into), so they are copied into the batch at once."""

    tokens: np.ndarray
    prompt_length: int
    trained: Sequence[Span]
    reward: float = 0.0


def _trailing_ones(lengths: np.ndarray, width: int) -> np.ndarray:
    """``[B, width]`` int64 masks whose last ``lengths[i]`` entries of row ``i`` are 1.

    Each row is a slice of one ``[0] * width + [1] * width`` template, copied: a plain copy per row
    takes under half the time of broadcasting a comparison into int64 (numpy casts it through a
    buffer; bench/README.md: 'The data adapter')."""
    template = np.zeros(2 * width, dtype=np.int64)
    template[width:] = 1
    mask = np.empty((len(lengths), width), dtype=np.int64)
    for row, length in zip(mask, lengths.tolist(), strict=True):
        row[:] = template[length : length + width]
    return mask


def build_rows(
    pad_token_id: int, rows: Sequence[RowSpec], *, logprobs: bool, advantages: bool
) -> dict[str, torch.Tensor]:
    """Rows -> SkyRL's tensors, exactly as ``convert_prompts_responses_to_batch_tensors`` lays them out.

    SkyRL's builder takes one Python list per row and field; this one copies each row's ids and
    spans straight into preallocated arrays, which keeps a 2 M-token batch in tens of milliseconds.
    """
    if not rows:
        raise ValueError("no rows to lay out")
    num_rows = len(rows)
    totals = np.fromiter((len(row.tokens) for row in rows), dtype=np.int64, count=num_rows)
    response_lens = totals - np.fromiter((row.prompt_length for row in rows), dtype=np.int64, count=num_rows)
    max_total = int(totals.max())
    width = int(response_lens.max())

    sequences = np.empty((num_rows, max_total), dtype=np.int64)
    loss_mask = np.zeros((num_rows, width), dtype=np.float32)
    rewards = np.zeros((num_rows, width), dtype=np.float32)
    logprobs_BT = np.zeros((num_rows, width), dtype=np.float32) if logprobs else None
    advantages_BT = np.zeros((num_rows, width), dtype=np.float32) if advantages else None
    starts, columns = (max_total - totals).tolist(), (width - response_lens).tolist()
    for i, row in enumerate(rows):
        # Row views: 1-D slice assignment costs half of indexing the 2-D arrays span by span.
        sequence, mask = sequences[i], loss_mask[i]
        row_logprobs = logprobs_BT[i] if logprobs_BT is not None else None
        row_advantages = advantages_BT[i] if advantages_BT is not None else None
        sequence[: starts[i]] = pad_token_id
        sequence[starts[i] :] = row.tokens
        for span in row.trained:
            begin = columns[i] + span.column
            end = begin + span.length
            mask[begin:end] = 1.0
            if row_logprobs is not None and span.logprobs is not None:
                row_logprobs[begin:end] = span.logprobs
            if row_advantages is not None and span.advantages is not None:
                row_advantages[begin:end] = span.advantages
    rewards[:, width - 1] = [row.reward for row in rows]
    arrays = {
        "sequences": sequences,
        "attention_mask": _trailing_ones(totals, max_total),
        "response_mask": _trailing_ones(response_lens, width),
        "loss_mask": loss_mask,
        "rewards": rewards,
        "rollout_logprobs": logprobs_BT,
        "advantages": advantages_BT,
    }
    return {key: torch.from_numpy(array) for key, array in arrays.items() if array is not None}


def right_aligned(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Per-row response arrays -> ``[B, width]`` float32, right-aligned.

    One scatter of the concatenated rows, not a tensor per row: a step's worker outputs are
    hundreds of short rows.
    """
    lengths_B = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    if (lengths_B > width).any():
        i = int(np.argmax(lengths_B > width))
        raise ValueError(f"row {i} has {lengths_B[i]} values, more than the width {width}")
    out_BT = np.zeros((len(rows), width), dtype=np.float32)
    filled_BT = np.arange(width) >= width - lengths_B[:, None]
    out_BT[filled_BT] = np.fromiter(chain.from_iterable(rows), dtype=np.float32, count=int(lengths_B.sum()))
    return torch.from_numpy(out_BT)


def last_tokens(values: Sequence[float] | torch.Tensor, n: int) -> list[float]:
    """A row's ``n`` response tokens out of a right-aligned array."""
    values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    return values[len(values) - n :] if n else []


def stack_rows(outputs: Sequence[Mapping[str, Any]], key: str) -> torch.Tensor:
    """Per-row worker outputs already as wide as the response window -> ``[B, T]`` float32."""
    return torch.stack([torch.as_tensor(o[key], dtype=torch.float32) for o in outputs])


def real_rows(batch: TrainingInputBatch) -> int:
    return batch.batch_size - int((batch.metadata or {}).get("pad_size", 0))


def pad_to_multiple(batch: TrainingInputBatch, dp_size: int) -> TrainingInputBatch:
    """Pad to a multiple of ``dp_size`` rows; already padded rows stay counted in ``pad_size``."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    already = int((batch.metadata or {}).get("pad_size", 0))
    extra = (-batch.batch_size) % dp_size
    padded = pad_training_input_batch(batch, extra)
    if "row_ids" in padded.metadata:
        padded.metadata["row_ids"] = list(batch.metadata["row_ids"]) + [PAD_ROW_ID] * extra
    padded.metadata["pad_size"] = already + extra
    return padded


def row_slice(batch: TrainingInputBatch, start: int, end: int, dp_size: int) -> TrainingInputBatch:
    """Real rows ``[start, end)`` as a batch of their own, metadata to match, padded for ``dp_size``."""
    if not 0 <= start < end <= real_rows(batch):
        raise ValueError(f"rows [{start}, {end}) are outside the {real_rows(batch)} real rows")
    return _padded_part(batch, batch.slice(start, end), range(start, end), dp_size)


def select_rows(batch: TrainingInputBatch, rows: Sequence[int], dp_size: int) -> TrainingInputBatch:
    """Any real rows (e.g. the rows of one role within a mini-batch), metadata to match, padded."""
    index = torch.tensor(list(rows), dtype=torch.long)
    part = TrainingInputBatch({key: None if value is None else value[index] for key, value in batch.items()})
    return _padded_part(batch, part, rows, dp_size)


def _padded_part(
    batch: TrainingInputBatch, part: TrainingInputBatch, rows: Sequence[int], dp_size: int
) -> TrainingInputBatch:
    metadata = dict(batch.metadata)
    for key in ("uids", "row_ids"):
        if key in metadata:
            metadata[key] = [metadata[key][i] for i in rows]
    metadata["pad_size"] = 0
    part.metadata = metadata
    return pad_to_multiple(part, dp_size)
