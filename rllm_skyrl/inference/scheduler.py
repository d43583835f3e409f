"""The generation loop: continuous batching of many requests over one HF causal LM.

A single thread owns the model. Each turn of its loop it runs the queued control calls
(weight loads, pause, ...), admits waiting requests (one left-padded prefill of their distinct
prompts, whose KV cache is copied to every row sampling from the same prompt, left-padded again and
concatenated onto the running batch's), runs one batched decode step, and retires the rows that
finished. Requests therefore join and leave the batch at token granularity, instead of waiting for
the slowest member of a static batch. An idle loop lets a burst of requests finish arriving before
it admits them (``BURST_GAP_S``), so a step's requests share one prefill.

The queue of waiting requests is bounded (a full queue refuses with 503 and ``Retry-After``),
and a request whose caller went away is cancelled: it leaves the queue, or the batch before the
next decode step. ``counters`` count what the loop did (prefills, KV-cache merges, decode steps,
tokens, prefill positions (distinct prompts x their padded width), cancellations), so callers and
tests can see it without timing anything.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rllm_skyrl.inference.errors import ApiError
from rllm_skyrl.inference.sampling import BatchSampler, SampleResult, SamplingParams
from rllm_skyrl.inference.weights import LoraAdapters, WeightsRoot

logger = logging.getLogger(__name__)

PAUSE_MODES = ("keep", "wait", "abort")
# An idle server admits a burst of requests as one prefill: while they keep coming, each within
# BURST_GAP_S of the last, it waits for the next, at most BURST_MAX_WAIT_S after the first. Clients
# send a step's requests together, but the HTTP thread hands them over one by one; admitted as
# they come, the first few would be prefilled and decoded on their own, the rest after them.
BURST_GAP_S = 0.002
BURST_MAX_WAIT_S = 0.02
COUNTERS = ("prefills", "prefill_tokens", "merges", "decode_steps", "tokens", "cancelled", "peak_running")


@dataclass
class GenerationResult:
    """What one request produced; ``stop_reason`` is the stop token id or string that ended it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None


Callback = Callable[[GenerationResult | BaseException], None]


class _Request:
    """A request's state while it waits or runs; touched only by the generation thread once queued."""

    def __init__(self, seq, prompt_ids, params, adapter, max_new, stop_ids, on_done):
        self.seq: int = seq
        self.prompt_ids: list[int] = prompt_ids
        self.prompt_key: tuple[int, ...] = tuple(prompt_ids)  # rows with equal keys share a prefill
        self.params: SamplingParams = params
        self.adapter: str | None = adapter
        self.max_new: int = max_new
        self.stop_ids: frozenset[int] = stop_ids
        self.on_done: Callback = on_done
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.top: list[list[tuple[int, float]]] | None = [] if params.logprobs else None
        self.stop_window = max((len(s) for s in params.stop), default=0) + 2
        self.done = False
        self.cancelled = False

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self._deliver(
            GenerationResult(self.prompt_ids, self.token_ids, self.logprobs, self.top, reason, stop_reason)
        )

    def fail(self, exc: BaseException) -> None:
        self._deliver(exc)

    def _deliver(self, outcome: GenerationResult | BaseException) -> None:
        if self.done:
            return
        self.done = True
        try:
            self.on_done(outcome)
        except Exception:  # a broken callback must not take the generation loop down
            logger.exception("result callback failed for request %d", self.seq)


class _Batch:
    """The running rows: a KV cache over ``[pad | prompt | generated]`` columns plus per-row state."""

    def __init__(self, rows, cache, mask, positions, last, sampler):
        self.rows: list[_Request] = rows
        self.cache: DynamicCache = cache
        self.mask: torch.Tensor = mask  # [B, T] 1 = real token
        self.positions: torch.Tensor = positions  # [B] position id of the next input token
        self.last: torch.Tensor = last  # [B] next input token
        self.sampler: BatchSampler = sampler


class Scheduler:
    """Owns the model; every model access (generation, weight swaps, adapters) runs on its thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_model_len: int,
        max_batch_size: int = 256,
        max_prefill_tokens: int = 8192,
        max_waiting: int = 4096,
        seed: int = 0,
        can_merge: bool = True,
        weights_root: WeightsRoot | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_waiting = max_waiting
        self.can_merge = can_merge
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.lora = LoraAdapters(model, weights_root or WeightsRoot(None))
        self.weight_version = 0
        self._rng = torch.Generator().manual_seed(seed)
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._stopping = False
        self._cancel_pending = False
        self._last_submit = 0.0  # time.monotonic() of the last submit
        self._thread: threading.Thread | None = None
        # What the loop did; peak_running is a high-water mark. Every key exists from the start, so
        # reading the counters from another thread never sees the dict change size.
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        # Generation-thread state.
        self._batch: _Batch | None = None
        self._pause: str | None = None
        self._pause_gate = -1  # in "wait" mode, requests with seq <= gate still run
        self._drain_waiters: list[Future] = []
        self.sleeping_tags: set[str] = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rllm-skyrl-generation", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ requests
    def submit(
        self, jobs: list[tuple[list[int], SamplingParams, Callback]], adapter: str | None = None
    ) -> list[_Request]:
        """Queue ``(prompt_ids, params, on_done)`` requests, all or none (thread-safe).

        ``on_done`` is called from the generation thread. ``max_tokens`` is capped by the room
        left in the context window; a request that hits that cap finishes with ``"length"``
        rather than being refused. A full queue refuses the lot with 503.
        """
        prepared = []
        for prompt_ids, params, on_done in jobs:
            self.check_prompt(prompt_ids)
            room = self.max_model_len - len(prompt_ids)
            max_new = min(params.max_tokens or room, room)
            stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
            prepared.append((prompt_ids, params, max_new, stop_ids, on_done))
        with self._cv:
            if len(self._waiting) + len(prepared) > self.max_waiting:
                raise ApiError(
                    503,
                    f"the server's queue is full ({len(self._waiting)} requests waiting, at most "
                    f"{self.max_waiting}); retry shortly",
                    {"Retry-After": "1"},
                )
            requests = [_Request(next(self._seq), p, sp, adapter, m, s, cb) for p, sp, m, s, cb in prepared]
            self._waiting.extend(requests)
            self._last_submit = time.monotonic()
            self._cv.notify_all()
        return requests

    def cancel(self, requests: list[_Request]) -> None:
        """Abort requests nobody waits for any more (thread-safe): they finish with ``"abort"``,
        leaving the queue, or the batch before its next decode step."""
        with self._cv:
            for request in requests:
                request.cancelled = True
            self._cancel_pending = True
            self._cv.notify_all()

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not isinstance(prompt_ids, list) or not prompt_ids:
            raise ApiError(400, "the prompt is empty; send at least one token id")
        if not all(type(t) is int for t in prompt_ids):
            raise ApiError(400, "token_ids must be a list of integers")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise ApiError(
                400, f"token ids must lie in [0, {self.vocab_size}); got {min(prompt_ids)}..{max(prompt_ids)}"
            )
        if len(prompt_ids) >= self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(prompt_ids)} tokens (at least one token must be left to generate); shorten the prompt "
                "or restart the server with a larger --max-model-len (up to max_position_embeddings)",
            )

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running_rows())

    def running_rows(self) -> list[_Request]:
        """Rows still generating. A row's result is delivered (and its caller may read the stats)
        before the batch drops it at the end of the step, so delivered rows are left out here."""
        batch = self._batch
        return [r for r in batch.rows if not r.done] if batch is not None else []

    # ------------------------------------------------------------------ control plane
    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the generation thread between decode steps; the future holds its result."""
        future: Future = Future()
        with self._cv:
            if self._stopping:
                raise ApiError(503, "the inference server is shutting down")
            self._calls.append((fn, future))
            self._cv.notify_all()
        return future

    def pause(self, mode: str) -> Future:
        """Stop generating. keep: freeze running requests; abort: finish everything already
        submitted with ``finish_reason="abort"``; wait: let it finish. New requests wait for
        ``resume`` in every mode. The future resolves once the pause holds."""
        if mode not in PAUSE_MODES:
            raise ApiError(400, f"unknown pause mode {mode!r}; use one of {list(PAUSE_MODES)}")
        with self._cv:
            gate = next(self._seq)  # every request submitted so far has a smaller seq

        def apply() -> Future | None:
            self._pause, self._pause_gate = mode, gate
            if mode == "abort":
                self._abort_through(gate)
            if mode == "wait" and not self._drained():
                waiter: Future = Future()
                self._drain_waiters.append(waiter)
                return waiter
            return None

        return _chain(self.call(apply))

    def resume(self) -> Future:
        def apply() -> None:
            self._pause = None
            self._release_drain_waiters()

        return self.call(apply)

    @property
    def paused(self) -> bool:
        return self._pause is not None

    # ------------------------------------------------------------------ generation thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._has_work():
                    self._cv.wait()
                if self._batch is None:
                    self._await_burst()
                if self._stopping:
                    break
                calls = list(self._calls)
                self._calls.clear()
            for fn, future in calls:
                self._run_call(fn, future)
            if self._cancel_pending:
                self._drop_cancelled()
            if self._can_run():
                self._step()
            if self._pause == "wait" and self._drained():
                self._release_drain_waiters()
        self._shutdown()

    def _step(self) -> None:
        """Admit what may join, then advance every running row by one token."""
        admitted: list[_Request] = []
        try:
            with torch.inference_mode():
                admitted = self._take_admissible()
                rows = self.running_rows() or admitted
                if rows:
                    # Re-applied every step: an adapter load in between may have switched it.
                    self.lora.activate(rows[0].adapter)
                if admitted:
                    self._prefill(admitted)
                if self._batch is not None:
                    self._decode_step()
        except Exception as exc:  # fail the affected requests, keep serving the others
            logger.exception("generation step failed")
            for row in admitted + (self._batch.rows if self._batch is not None else []):
                row.fail(exc)
            self._batch = None

    def _await_burst(self) -> None:
        """With nothing running, let a burst of requests finish arriving (holding ``_cv``)."""
        first = self._last_submit
        while self._waiting and not (self._stopping or self._calls or self._cancel_pending):
            now = time.monotonic()
            wake = min(self._last_submit + BURST_GAP_S, first + BURST_MAX_WAIT_S)
            if now >= wake:
                return
            self._cv.wait(wake - now)

    def _has_work(self) -> bool:
        if self._stopping or self._calls or self._cancel_pending:
            return True
        if not self._can_run():
            return False
        return self._batch is not None or (bool(self._waiting) and self._admissible(self._waiting[0]))

    def _can_run(self) -> bool:
        return not self.sleeping_tags and self._pause in (None, "wait")

    def _admissible(self, request: _Request) -> bool:
        return self._pause is None or request.seq <= self._pause_gate

    def _run_call(self, fn: Callable[[], Any], future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            with torch.no_grad():
                future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    def _take_admissible(self) -> list[_Request]:
        """Pop the waiting requests that may join now: FIFO, same adapter as the running batch,
        within the batch size and the prefill token budget (of distinct prompts: the samples of one
        prompt share its prefill)."""
        running = self._batch.rows if self._batch is not None else []
        if running and not self.can_merge:
            return []
        adapter = running[0].adapter if running else None
        taken: list[_Request] = []
        prompts: set[tuple[int, ...]] = set()
        longest = 0
        with self._cv:
            while self._waiting and len(running) + len(taken) < self.max_batch_size:
                request = self._waiting[0]
                if not self._admissible(request):
                    break
                if not taken and not running:
                    adapter = request.adapter
                if request.adapter != adapter:
                    break
                if request.prompt_key not in prompts:
                    width = max(longest, len(request.prompt_ids))
                    if taken and width * (len(prompts) + 1) > self.max_prefill_tokens:
                        break
                    prompts.add(request.prompt_key)
                    longest = width
                taken.append(self._waiting.popleft())
        if taken and adapter not in (None, *self.lora.names):
            err = ApiError(404, f"LoRA adapter {adapter!r} was unloaded before the request ran")
            for request in taken:
                request.fail(err)
            return []
        return taken

    def _prefill(self, rows: list[_Request]) -> None:
        """Run the distinct prompts of ``rows`` as one left-padded batch, copy each prompt's KV cache
        and last logits to the rows sampling from it, sample their first token, and merge the
        survivors into the running batch."""
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
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        if len(distinct) < len(rows):
            index = torch.tensor(source)
            cache = DynamicCache([(k[index], v[index]) for k, v, *_ in cache])
            mask, positions, logits = mask[index], positions[index], logits[index]
        self.counters["prefill_tokens"] += int(ids.numel())
        self.counters["prefills"] += 1
        sampler = self._sampler(rows)
        result = sampler.sample(logits.float())
        new = _Batch(rows, cache, mask, positions[:, -1] + 1, torch.tensor(result.tokens), sampler)
        keep = self._record(rows, result)
        if len(keep) < len(rows):
            new = self._select(new, keep)
        if new is None:
            return
        if self._batch is None:
            self._batch = new
            self.counters["peak_running"] = max(self.counters["peak_running"], len(new.rows))
        else:
            self._batch = self._merge(self._batch, new)

    def _decode_step(self) -> None:
        batch = self._batch
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
        keep = self._record(batch.rows, result)
        if len(keep) < len(batch.rows):
            self._batch = self._select(batch, keep)

    def _sampler(self, rows: list[_Request]) -> BatchSampler:
        return BatchSampler(
            [r.params for r in rows],
            [r.generator for r in rows],
            self._rng,
            [len(r.token_ids) for r in rows],
            [r.stop_ids for r in rows],
        )

    def _record(self, rows: list[_Request], result: SampleResult) -> list[int]:
        """Append each row's new token, finish the rows that are done; return the rows to keep."""
        self.counters["tokens"] += len(rows)
        keep = []
        for i, (row, token) in enumerate(zip(rows, result.tokens, strict=True)):
            row.token_ids.append(token)
            if row.logprobs is not None:
                row.logprobs.append(result.logprobs[i])
            if row.top is not None:
                row.top.append(result.top[i])
            if token in row.stop_ids:
                row.finish("stop", token if token in row.params.stop_token_ids else None)
            elif (stop := self._stop_string(row)) is not None:
                row.finish("stop", stop)
            elif len(row.token_ids) >= row.max_new:
                row.finish("length")
            else:
                keep.append(i)
        return keep

    def _stop_string(self, row: _Request) -> str | None:
        if not row.params.stop or len(row.token_ids) <= row.params.min_tokens:
            return None
        tail = self.tokenizer.decode(
            row.token_ids[-row.stop_window :], skip_special_tokens=row.params.skip_special_tokens
        )
        return next((s for s in row.params.stop if s in tail), None)

    def _select(self, batch: _Batch, keep: list[int]) -> _Batch | None:
        """Drop finished rows, then the left columns that are padding in every remaining row."""
        if not keep:
            return None
        idx = torch.tensor(keep)
        mask = batch.mask[idx]
        start = int(mask.any(dim=0).long().argmax())
        layers = [(k[idx, :, start:], v[idx, :, start:]) for k, v, *_ in batch.cache]
        rows = [batch.rows[i] for i in keep]
        sampler = self._sampler(rows)
        return _Batch(
            rows, DynamicCache(layers), mask[:, start:], batch.positions[idx], batch.last[idx], sampler
        )

    def _merge(self, a: _Batch, b: _Batch) -> _Batch:
        """Concatenate two batches, left-padding the shorter one's cache and mask."""
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
        self.counters["peak_running"] = max(self.counters["peak_running"], len(rows))
        sampler = self._sampler(rows)
        return _Batch(
            rows,
            DynamicCache(layers),
            torch.cat([pad(a.mask, 1), pad(b.mask, 1)]),
            torch.cat([a.positions, b.positions]),
            torch.cat([a.last, b.last]),
            sampler,
        )

    def _drop_cancelled(self) -> None:
        with self._cv:
            self._cancel_pending = False
            gone = [r for r in self._waiting if r.cancelled]
            self._waiting = deque(r for r in self._waiting if not r.cancelled)
        if self._batch is not None:
            gone += [r for r in self._batch.rows if r.cancelled]
            keep = [i for i, r in enumerate(self._batch.rows) if not r.cancelled]
            if len(keep) < len(self._batch.rows):
                self._batch = self._select(self._batch, keep)
        for request in gone:
            if not request.done:
                self.counters["cancelled"] += 1
                request.finish("abort")

    # ------------------------------------------------------------------ pause helpers
    def _abort_through(self, gate: int) -> None:
        """Finish every request submitted before the pause with ``finish_reason="abort"``."""
        if self._batch is not None:
            keep = []
            for i, row in enumerate(self._batch.rows):
                if row.seq <= gate:
                    row.finish("abort")
                else:
                    keep.append(i)
            self._batch = self._select(self._batch, keep)
        with self._cv:
            doomed = [r for r in self._waiting if r.seq <= gate]
            self._waiting = deque(r for r in self._waiting if r.seq > gate)
        for request in doomed:
            request.finish("abort")

    def _drained(self) -> bool:
        with self._cv:
            waiting = any(r.seq <= self._pause_gate for r in self._waiting)
        return self._batch is None and not waiting

    def _release_drain_waiters(self) -> None:
        for waiter in self._drain_waiters:
            waiter.set_result(None)
        self._drain_waiters.clear()

    def _shutdown(self) -> None:
        err = ApiError(503, "the inference server shut down before the request finished")
        with self._cv:
            rows = [*self.running_rows(), *self._waiting]
            self._waiting.clear()
            calls = list(self._calls)
            self._calls.clear()
        for row in rows:
            row.fail(err)
        for _, future in calls:
            future.set_exception(err)
        self._release_drain_waiters()


def _chain(outer: Future) -> Future:
    """A future that resolves when ``outer`` does, or when the future ``outer`` returned does."""
    done: Future = Future()

    def on_outer(f: Future) -> None:
        if f.exception() is not None:
            done.set_exception(f.exception())
        elif isinstance(f.result(), Future):
            f.result().add_done_callback(lambda inner: done.set_result(None))
        else:
            done.set_result(None)

    outer.add_done_callback(on_outer)
    return done


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config and the tokenizer (models often list several)."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)
