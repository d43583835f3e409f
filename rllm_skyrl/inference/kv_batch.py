"""The running batch: the rows decoding together, their KV cache, and the tensor work on it.

Rows are left-padded (``[pad | prompt | generated]``), so every row's newest token is in the last
column and one forward pass advances all of them. A prefill runs only the distinct prompts of the
rows it admits and copies each prompt's KV cache to the rows sampling from it; new rows join by a
merge that left-pads the narrower cache, finished rows leave by a select that also drops the left
columns only padding is left in. A prefill keeps every position's logits only when a row asks for
its prompt's logprobs (``echo``). Which requests run is the scheduler's business.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rllm_skyrl.inference.generation_request import GenerationRequest
from rllm_skyrl.inference.prompt_logprobs import PromptLogprobs, score_prompt
from rllm_skyrl.inference.sampling import BatchSampler, SampleResult


@dataclass
class KVBatch:
    """Rows with their KV cache and per-row state; the sampler is rebuilt whenever the rows change."""

    rows: list[GenerationRequest]
    cache: DynamicCache
    mask: torch.Tensor  # [B, T] 1 = real token
    positions: torch.Tensor  # [B] position id of the next input token
    last: torch.Tensor  # [B] next input token
    sampler: BatchSampler


class RunningBatch:
    """Used on the generation thread only, except ``rows``; counts into the scheduler's ``counters``."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, rng: torch.Generator, counters: Counter[str]):
        self.model = model
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id or 0
        self.rng = rng
        self.counters = counters
        self.batch: KVBatch | None = None

    @property
    def rows(self) -> list[GenerationRequest]:
        """The batch's rows, including any whose result was delivered this step (safe from any thread)."""
        batch = self.batch
        return batch.rows if batch is not None else []

    def admit(self, rows: list[GenerationRequest]) -> None:
        """Prefill ``rows`` and sample their first token; the rows still running join the batch."""
        distinct: dict[tuple[int, ...], int] = {}
        source = [distinct.setdefault(r.prompt_key, len(distinct)) for r in rows]
        width = max(len(prompt) for prompt in distinct)
        ids = torch.full((len(distinct), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for i, prompt in enumerate(distinct):
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        scored = [i for i, r in enumerate(rows) if r.params.prompt_logprobs is not None]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if scored else 1,  # every position only when a row scores its prompt
        )
        logits = out.logits[:, -1, :]
        scores: dict[tuple[int, int], PromptLogprobs] = {}  # the samples of one prompt share its score
        for i in scored:
            row, key = rows[i], (source[i], rows[i].params.prompt_logprobs)
            if key not in scores:
                scores[key] = score_prompt(
                    out.logits[source[i], width - len(row.prompt_ids) :], row.prompt_ids, key[1]
                )
            row.prompt_logprobs = scores[key]
        if len(distinct) < len(rows):
            index = torch.tensor(source)
            cache = DynamicCache([(k[index], v[index]) for k, v, *_ in cache])
            mask, positions, logits = mask[index], positions[index], logits[index]
        self.counters["prefill_tokens"] += int(ids.numel())
        self.counters["prefills"] += 1
        sampler = self._sampler(rows)
        result = sampler.sample(logits.float())
        new = KVBatch(rows, cache, mask, positions[:, -1] + 1, torch.tensor(result.tokens), sampler)
        keep = self._record(rows, result)
        if len(keep) < len(rows):
            new = self._select(new, keep)
        if new is None:
            return
        self.batch = new if self.batch is None else self._merge(self.batch, new)
        self.counters["peak_running"] = max(self.counters["peak_running"], len(self.batch.rows))

    def decode_step(self) -> None:
        batch = self.batch
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((batch.mask.shape[0], 1))], dim=1)
        out = self.model(
            input_ids=batch.last.unsqueeze(1),
            attention_mask=batch.mask,
            position_ids=batch.positions.unsqueeze(1),
            past_key_values=batch.cache,
            use_cache=True,
        )
        self.counters["decode_steps"] += 1
        result = batch.sampler.sample(out.logits[:, -1, :].float())
        batch.positions = batch.positions + 1
        batch.last = torch.tensor(result.tokens)
        self.keep(self._record(batch.rows, result))

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at the indices ``keep``; the caller finishes the others."""
        if self.batch is not None and len(keep) < len(self.batch.rows):
            self.batch = self._select(self.batch, keep)

    def _sampler(self, rows: list[GenerationRequest]) -> BatchSampler:
        return BatchSampler(
            [r.params for r in rows],
            [r.generator for r in rows],
            self.rng,
            [len(r.token_ids) for r in rows],
            [r.stop_ids for r in rows],
        )

    def _record(self, rows: list[GenerationRequest], result: SampleResult) -> list[int]:
        """The indices of the rows still running after this step's tokens."""
        self.counters["tokens"] += len(rows)
        return [
            i
            for i, (row, token) in enumerate(zip(rows, result.tokens, strict=True))
            if row.add_token(token, result.logprobs[i], result.top[i] if result.top else None, self.tokenizer)
        ]

    def _select(self, batch: KVBatch, keep: list[int]) -> KVBatch | None:
        if not keep:
            return None
        idx = torch.tensor(keep)
        mask = batch.mask[idx]
        start = int(mask.any(dim=0).long().argmax())
        layers = [(k[idx, :, start:], v[idx, :, start:]) for k, v, *_ in batch.cache]
        rows = [batch.rows[i] for i in keep]
        sampler = self._sampler(rows)
        return KVBatch(
            rows, DynamicCache(layers), mask[:, start:], batch.positions[idx], batch.last[idx], sampler
        )

    def _merge(self, a: KVBatch, b: KVBatch) -> KVBatch:
        width = max(a.mask.shape[1], b.mask.shape[1])

        def pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = width - t.shape[-dim_from_end]
            if not missing:
                return t
            return F.pad(t, (0, 0) * (dim_from_end - 1) + (missing, 0))

        layers = [
            (torch.cat([pad(ka, 2), pad(kb, 2)]), torch.cat([pad(va, 2), pad(vb, 2)]))
            for (ka, va, *_), (kb, vb, *_) in zip(a.cache, b.cache, strict=True)
        ]
        rows = a.rows + b.rows
        self.counters["merges"] += 1
        return KVBatch(
            rows,
            DynamicCache(layers),
            torch.cat([pad(a.mask, 1), pad(b.mask, 1)]),
            torch.cat([a.positions, b.positions]),
            torch.cat([a.last, b.last]),
            self._sampler(rows),
        )
