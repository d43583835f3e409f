"""SkyRL's ``TrainingInputBatch`` layout, written once: right-aligned responses, DP padding, row slices.

SkyRL's rows (``skyrl/train/dataset/preprocess.py``) are ``[PAD | prompt | response]`` with
response-level tensors ``[B, response_len]`` right-aligned, so a row's response tokens are its
*last* ``n`` positions. Every rank of a data-parallel group must get the same number of rows:
batches are padded with SkyRL's own ``pad_training_input_batch`` (copies of row 0 whose
``loss_mask`` is 0). ``metadata`` keys this package reads and keeps consistent:

    uids             group id per row (SkyRL's prompt identity); pad rows get SkyRL's ``pad<i>``
    row_ids          who a row came from, for error messages; pad rows get ``PAD_ROW_ID``
    response_length  width of the response-level tensors
    pad_size         how many trailing rows are DP padding
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch, pad_training_input_batch

PAD_ROW_ID = "<pad>"


def right_aligned(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Per-row arrays (each a row's response tokens) -> ``[B, width]`` float32, right-aligned."""
    out_BT = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        if len(row):
            out_BT[i, width - len(row) :] = torch.as_tensor(row, dtype=torch.float32)
    return out_BT


def last_tokens(values: Sequence[float] | torch.Tensor, n: int) -> list[float]:
    """A row's ``n`` response tokens out of a right-aligned array."""
    values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    return values[len(values) - n :] if n else []


def stack_rows(outputs: Sequence[Mapping[str, Any]], key: str) -> torch.Tensor:
    """Per-row worker outputs already as wide as the response window -> ``[B, T]`` float32."""
    return torch.stack([torch.as_tensor(o[key], dtype=torch.float32) for o in outputs])


def real_rows(batch: TrainingInputBatch) -> int:
    """Rows that are not DP padding."""
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
    part = batch.slice(start, end)
    metadata = dict(batch.metadata)
    for key in ("uids", "row_ids"):
        if key in metadata:
            metadata[key] = list(metadata[key][start:end])
    metadata["pad_size"] = 0
    part.metadata = metadata
    return pad_to_multiple(part, dp_size)


def select_rows(batch: TrainingInputBatch, rows: Sequence[int], dp_size: int) -> TrainingInputBatch:
    """Any real rows (e.g. the rows of one role within a mini-batch), metadata to match, padded."""
    index = torch.tensor(list(rows), dtype=torch.long)
    part = TrainingInputBatch({key: None if value is None else value[index] for key, value in batch.items()})
    metadata = dict(batch.metadata)
    for key in ("uids", "row_ids"):
        if key in metadata:
            metadata[key] = [metadata[key][i] for i in rows]
    metadata["pad_size"] = 0
    part.metadata = metadata
    return pad_to_multiple(part, dp_size)
