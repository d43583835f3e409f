"""A generation request's state while it waits or runs; its result or error is delivered exactly once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rllm_skyrl.inference.prompt_logprobs import PromptLogprobs
from rllm_skyrl.inference.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """What one request produced; ``stop_reason`` is the stop token id or string that ended it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str  # "stop" | "length" | "abort"
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | None = None  # when the params asked for them


Callback = Callable[[GenerationResult | BaseException], None]


@dataclass(eq=False)
class GenerationRequest:
    """A request's state while it waits or runs; touched only by the generation thread once queued."""

    seq: int
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    max_new: int
    stop_ids: frozenset[int]
    on_done: Callback

    def __post_init__(self) -> None:
        params = self.params
        self.prompt_key: tuple[int, ...] = tuple(self.prompt_ids)  # rows with equal keys share a prefill
        self.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.top: list[list[tuple[int, float]]] | None = [] if params.logprobs else None
        self.prompt_logprobs: PromptLogprobs | None = None  # set at prefill when asked for
        self.stop_window = max((len(s) for s in params.stop), default=0) + 2
        self.done = False
        self.cancelled = False

    def add_token(
        self, token: int, logprob: float, top: list[tuple[int, float]] | None, tokenizer: Any
    ) -> bool:
        """Append one sampled token, finishing the request if it is done; True while it keeps running."""
        self.token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.top is not None:
            self.top.append(top)
        if token in self.stop_ids:
            self.finish("stop", token if token in self.params.stop_token_ids else None)
        elif (stop := self._stop_string(tokenizer)) is not None:
            self.finish("stop", stop)
        elif len(self.token_ids) >= self.max_new:
            self.finish("length")
        else:
            return True
        return False

    def _stop_string(self, tokenizer: Any) -> str | None:
        if not self.params.stop or len(self.token_ids) <= self.params.min_tokens:
            return None
        tail = tokenizer.decode(
            self.token_ids[-self.stop_window :], skip_special_tokens=self.params.skip_special_tokens
        )
        return next((s for s in self.params.stop if s in tail), None)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self._deliver(
            GenerationResult(
                self.prompt_ids,
                self.token_ids,
                self.logprobs,
                self.top,
                reason,
                stop_reason,
                self.prompt_logprobs,
            )
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


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config and the tokenizer (models often list several)."""
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)
