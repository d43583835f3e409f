"""The generation loop: continuous batching of many requests over one HF causal LM.

A single thread owns the model. Each turn it runs the queued control calls (weight loads, pause,
...), admits waiting requests into the running batch (``kv_batch``), runs one batched decode step
and retires the rows that finished, so requests join and leave at token granularity instead of
waiting for the slowest member of a static batch. ``counters`` record what the loop did
(``prefill_tokens``: distinct prompts x their padded width), so tests need not time anything.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from rllm_skyrl.inference.errors import ApiError
from rllm_skyrl.inference.generation_request import Callback, GenerationRequest, eos_ids
from rllm_skyrl.inference.kv_batch import RunningBatch
from rllm_skyrl.inference.sampling import SamplingParams
from rllm_skyrl.inference.weights import LoraAdapters, WeightsRoot

logger = logging.getLogger(__name__)

PAUSE_MODES = ("keep", "wait", "abort")
# An idle server admits a burst of requests as one prefill: while they keep coming, each within
# BURST_GAP_S of the last, it waits for the next, at most BURST_MAX_WAIT_S after the first. Clients
# send a step's requests together, but the HTTP thread hands them over one by one; admitted as
# they come, the first few would be prefilled and decoded on their own, the rest after them.
BURST_GAP_S = 0.002
BURST_MAX_WAIT_S = 0.02
MAX_PREFILL_TOKENS = 8192  # distinct prompts x padded width in one admission's prefill
COUNTERS = ("prefills", "prefill_tokens", "merges", "decode_steps", "tokens", "cancelled", "peak_running")


class Scheduler:
    """Owns the model; every model access (generation, weight swaps, adapters) runs on its thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_model_len: int,
        max_batch_size: int,
        max_waiting: int,
        seed: int,
        can_merge: bool,
        weights_root: WeightsRoot,
    ):
        self.model = model
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.can_merge = can_merge
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.eos_ids = eos_ids(model, tokenizer)
        self.lora = LoraAdapters(model, weights_root)
        self.weight_version = 0
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._stopping = False
        self._cancel_pending = False
        self._last_submit = 0.0  # time.monotonic() of the last submit
        self._thread: threading.Thread | None = None
        # What the loop did; peak_running is a high-water mark. Every key exists from the start, so
        # reading the counters from another thread never sees the dict change size.
        self.counters: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        # Generation-thread state.
        self._running = RunningBatch(model, tokenizer, torch.Generator().manual_seed(seed), self.counters)
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
    ) -> list[GenerationRequest]:
        """Queue ``(prompt_ids, params, on_done)`` requests, all or none (thread-safe); ``on_done`` is
        called from the generation thread. A ``max_tokens`` beyond the context window is not
        refused: the request finishes with ``"length"`` where the window ends."""
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
            requests = [
                GenerationRequest(next(self._seq), p, sp, adapter, m, s, cb) for p, sp, m, s, cb in prepared
            ]
            self._waiting.extend(requests)
            self._last_submit = time.monotonic()
            self._cv.notify_all()
        return requests

    def cancel(self, requests: list[GenerationRequest]) -> None:
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

    def running_rows(self) -> list[GenerationRequest]:
        """Rows still generating. A row's result is delivered (and its caller may read the stats)
        before the batch drops it at the end of the step, so delivered rows are left out here."""
        return [r for r in self._running.rows if not r.done]

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
        held: Future = Future()
        held.set_running_or_notify_cancel()  # uncancellable: only the generation thread settles it

        def apply() -> None:
            self._pause, self._pause_gate = mode, gate
            if mode == "abort":
                for request in self._take_out(lambda r: r.seq <= gate):
                    request.finish("abort")
            if mode == "wait" and not self._drained():
                self._drain_waiters.append(held)
            else:
                held.set_result(None)

        def pass_on_failure(call: Future) -> None:  # e.g. the server shut down before the call ran
            if call.exception() is not None:
                held.set_exception(call.exception())

        self.call(apply).add_done_callback(pass_on_failure)
        return held

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
                if not self._running.rows:
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
        admitted: list[GenerationRequest] = []
        try:
            with torch.inference_mode():
                admitted = self._take_admissible()
                rows = self.running_rows() or admitted
                if rows:
                    # Re-applied every step: an adapter load in between may have switched it.
                    self.lora.activate(rows[0].adapter)
                if admitted:
                    self._running.admit(admitted)
                if self._running.rows:
                    self._running.decode_step()
        except Exception as exc:  # fail the affected requests, keep serving the others
            logger.exception("generation step failed")
            for row in admitted + self._running.rows:
                row.fail(exc)
            self._running.batch = None

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
        return bool(self._running.rows) or (bool(self._waiting) and self._admissible(self._waiting[0]))

    def _can_run(self) -> bool:
        return not self.sleeping_tags and self._pause in (None, "wait")

    def _admissible(self, request: GenerationRequest) -> bool:
        return self._pause is None or request.seq <= self._pause_gate

    def _run_call(self, fn: Callable[[], Any], future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            with torch.no_grad():
                future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    def _take_admissible(self) -> list[GenerationRequest]:
        """Pop the waiting requests that may join now: FIFO, same adapter as the running batch,
        within the batch size and the prefill token budget (of distinct prompts: the samples of one
        prompt share its prefill)."""
        running = self._running.rows
        if running and not self.can_merge:
            return []
        adapter = running[0].adapter if running else None
        taken: list[GenerationRequest] = []
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
                    if taken and width * (len(prompts) + 1) > MAX_PREFILL_TOKENS:
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

    def _drop_cancelled(self) -> None:
        with self._cv:
            self._cancel_pending = False
        for request in self._take_out(lambda r: r.cancelled):
            if not request.done:
                self.counters["cancelled"] += 1
                request.finish("abort")

    def _take_out(self, doomed: Callable[[GenerationRequest], bool]) -> list[GenerationRequest]:
        """Remove the requests ``doomed`` picks from the queue and the batch; the caller finishes them.

        A running row is asked ``doomed`` once: ``cancel`` may flag it meanwhile (the queue is read
        under the lock ``cancel`` takes), and a row must not leave the batch unfinished."""
        with self._cv:
            gone = [r for r in self._waiting if doomed(r)]
            self._waiting = deque(r for r in self._waiting if not doomed(r))
        rows = self._running.rows
        taken = [doomed(r) for r in rows]
        self._running.keep([i for i, out in enumerate(taken) if not out])
        return gone + [r for r, out in zip(rows, taken, strict=True) if out]

    # ------------------------------------------------------------------ pause helpers
    def _drained(self) -> bool:
        with self._cv:
            waiting = any(r.seq <= self._pause_gate for r in self._waiting)
        return not self._running.rows and not waiting

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
