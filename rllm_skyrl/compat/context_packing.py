"""Rows that share their context compute it once: a prompt's samples packed into one row.

GRPO samples every prompt n times, and SkyRL's batch repeats the prompt in each of the n rows
(``[PAD | prompt | response]``): for the quickstart most of every row's tokens are the prompt's,
computed once per sample.

Rows with the same context before the response window (same ids, same padding) go into one packed
row: the context once, then each row's window, under a mask that lets a window see the context and
itself only, each token at its position in its own row. Every window's logits are the row's own up
to float rounding (scores summed in another order), and gradients reach the shared context from all
its windows as they would reach each copy. It is one forward and one backward per layer, which FSDP
needs (a module called twice before one backward frees the weights the first call's backward reads).

How many windows go into one packed row is a trade: the context is computed once, but attention
scores grow with the square of the length (a window only reads its own part, yet the kernel
computes every pair). A token's projections and MLP cost about as much as ``PAIRS_PER_TOKEN`` x
hidden size attention pairs (sdpa with a mask, CPU: measured on the tiny model and on
SmolLM2-135M's layer shape), so a context of ``c`` tokens followed by windows of ``w`` costs least
per window with about ``sqrt(c^2 + rho c) / w`` of them, ``rho`` being that many pairs. The
estimate runs a little below what packing measures, and packing never measured more than the rows;
``MIN_SAVING`` packs only where the measured saving stays positive (figures and dates:
bench/README.md, 'A step').

Applies where the mask means what it says: sdpa attention (a custom 4D mask goes to the kernel
as given), full attention in every layer (a sliding window would be lost), and windows without
padding; and only where the estimate saves ``MIN_SAVING``. A packed row holds at most
``MAX_PACKED_LENGTH`` tokens (memory for its mask and scores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MAX_PACKED_LENGTH = 1024
MIN_SAVING = 0.15
PAIRS_PER_TOKEN = 4  # per unit of hidden size

_CONTEXT, _PADDING = -1, -2  # segment ids; a window's segment is its member index in the packed row


@dataclass(frozen=True)
class PackedBatch:
    """Packed rows ``[R, L]`` and where each original row's window sits in them."""

    ids: torch.Tensor  # [R, L]
    positions: torch.Tensor  # [R, L]
    mask: torch.Tensor  # [R, 1, L, L], True where a query may attend to a key
    row: torch.Tensor  # [B]: the packed row holding row b's window
    columns: torch.Tensor  # [B, width]: its columns there
    first_window_column: int  # no window starts before it: logits are needed from here on


def pairs_per_token(model: Any) -> float | None:
    """How many attention pairs cost as much as one token's projections and MLP in ``model``, or
    None where its attention does not honour a packed row's mask as given."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    packable = (
        getattr(config, "_attn_implementation", None) == "sdpa"
        and all(kind == "full_attention" for kind in layer_types)
        and getattr(config, "sliding_window", None) is None
    )
    return PAIRS_PER_TOKEN * config.hidden_size if packable else None


def _cost(length: int, pairs: float) -> float:
    """A row's forward in token units: its tokens, and its attention pairs at ``pairs`` per token."""
    return length + length * length / pairs


def pack(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    width: int,
    pairs: float,
) -> PackedBatch | None:
    """The packed layout of a batch whose rows end in a ``width``-token window, or None where
    packing does not apply or save ``MIN_SAVING`` (``pairs``: ``pairs_per_token``). Planned on the
    CPU, whatever device the model is on: a few index operations on the ids."""
    sequences, attention_mask, position_ids = sequences.cpu(), attention_mask.cpu(), position_ids.cpu()
    rows, total = sequences.shape
    split = total - width
    if rows < 2 or split <= 0 or not bool(attention_mask[:, split:].all()):
        return None
    context = torch.cat([sequences[:, :split], attention_mask[:, :split].to(sequences.dtype)], dim=1)
    _, group, counts = torch.unique(context, dim=0, return_inverse=True, return_counts=True)
    context_length = torch.zeros_like(counts).scatter_(0, group, attention_mask[:, :split].sum(1))
    best = (torch.sqrt(context_length.double() ** 2 + pairs * context_length) / width).round().long()
    per_packed_row = torch.minimum(best, (MAX_PACKED_LENGTH - context_length) // width).clamp(min=1)
    chunks = (counts + per_packed_row - 1) // per_packed_row
    # each row's index among the rows of its group, then its packed row and member index
    order = torch.argsort(group, stable=True)
    group_start = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(group)
    slot[order] = torch.arange(rows) - group_start[group[order]]
    packed_row = (torch.cumsum(chunks, 0) - chunks)[group] + slot // per_packed_row[group]
    member = slot % per_packed_row[group]

    packed_rows = int(chunks.sum())
    members = torch.zeros(packed_rows, dtype=torch.long).scatter_add_(0, packed_row, torch.ones_like(group))
    packed_group = torch.empty(packed_rows, dtype=torch.long).scatter_(0, packed_row, group)
    length = int((context_length[packed_group] + members * width).max())  # every packed row is padded to it
    if packed_rows * _cost(length, pairs) > (1 - MIN_SAVING) * rows * _cost(total, pairs):
        return None

    # the context: a row of the group's real context tokens, left-aligned
    first_row = order[group_start]  # one row of each group
    source = first_row[packed_group]
    packed_context = context_length[packed_group][:, None]
    column = torch.arange(length)[None, :]
    in_context = column < packed_context
    from_column = (split - packed_context + column).clamp(0, split - 1)
    ids = torch.where(in_context, sequences[source].gather(1, from_column), 0)
    positions = torch.where(in_context, position_ids[source].gather(1, from_column), 0)
    segment = torch.where(in_context, _CONTEXT, _PADDING)
    # each row's window after the context, in member order
    columns = (context_length[group] + member * width)[:, None] + torch.arange(width)
    ids[packed_row[:, None], columns] = sequences[:, split:]
    positions[packed_row[:, None], columns] = position_ids[:, split:]
    segment[packed_row[:, None], columns] = member[:, None]

    query, key = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = causal & (((key == _CONTEXT) & (query != _PADDING)) | ((key == query) & (query >= 0)))
    mask |= torch.eye(length, dtype=torch.bool)  # a padding token attends to itself: no empty softmax
    return PackedBatch(
        ids=ids,
        positions=positions,
        mask=mask[:, None],
        row=packed_row,
        columns=columns,
        first_window_column=int(context_length.min()),
    )


def packed_window_logits(
    model: Any,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    width: int,
    pairs: float | None,
) -> tuple[torch.Tensor, Any] | None:
    """``model``'s logits ``[B, width, V]`` of every row's last ``width`` positions and its output,
    computed on packed rows; None where packing does not apply. ``pairs``:
    ``pairs_per_token(model)``, asked once per model by the caller (None: rows are not packed)."""
    packed = None if pairs is None else pack(sequences, attention_mask, position_ids, width, pairs)
    if packed is None:
        return None
    device = sequences.device
    first = packed.first_window_column
    output = model(
        packed.ids.to(device),
        attention_mask=packed.mask.to(device),
        position_ids=packed.positions.to(device),
        logits_to_keep=torch.arange(first, packed.ids.shape[1], device=device),
        use_cache=False,
    )
    output["logits"] = output["logits"][packed.row.to(device)[:, None], (packed.columns - first).to(device)]
    return output["logits"], output
