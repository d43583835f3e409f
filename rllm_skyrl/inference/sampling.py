"""Sampling parameters (vLLM's names and meanings) and the batched sampler.

A sampled token's reported logprob is ``log_softmax(logits / temperature)[token]``: after
temperature, before top-k / top-p / min-p truncation and the ``min_tokens`` stop-token mask. That
is what the trainer recomputes (``log_softmax(logits / algorithm.temperature)``), so the
rollout/trainer importance ratio is 1 up to float error when the weights match, which off-policy
corrections and the tests rely on. Under truncation it is thus not the probability the token was
drawn with, deliberately (vLLM's default "raw logprobs" mode does the same). Greedy rows
(temperature 0) report ``log_softmax(logits)``. A reported logprob is always finite, never null.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rllm_skyrl.inference import checks
from rllm_skyrl.inference.checks import INT32_MAX, INT64_MAX, INT64_MIN

# vLLM sampling keys we accept and ignore because they only change things we do not have
# (output streaming kind, detokenizer spacing, prefix-cache reads, prompt logprob format).
_IGNORED_KEYS = frozenset(
    {
        "output_kind",
        "detokenize",
        "spaces_between_special_tokens",
        "skip_reading_prefix_cache",
        "flat_logprobs",
        "extra_args",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "routed_experts_prompt_start",
    }
)
# Keys we accept only at their neutral value: they change the distribution and are not implemented.
_NEUTRAL_KEYS = {
    "best_of": None,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "guided_decoding": None,
    "structured_outputs": None,
}
MAX_TOP_LOGPROBS = 20
# vLLM's floors: a smaller non-zero temperature overflows fp32 logits (leaving only NaN to report),
# and a reported logprob whose probability underflows fp32 is raised to LOGPROB_FLOOR.
MIN_TEMPERATURE = 0.01
LOGPROB_FLOOR = -9999.0
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024  # every decode step checks each running row's stops
MAX_STOP_TOKEN_IDS = 1024


def _logprobs(name: str, value: Any) -> int | None:
    """vLLM's reading: ``true`` is 1 alternative, ``false``/null none, k in [0, 20] the sampled
    token plus k alternatives."""
    if isinstance(value, bool):
        return 1 if value else None
    return checks.optional_integer(name, value, 0, MAX_TOP_LOGPROBS)


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "max_tokens": lambda k, v: checks.optional_integer(k, v, 1, INT32_MAX),
    "min_tokens": lambda k, v: checks.integer(k, v, 0, INT32_MAX),
    "temperature": lambda k, v: checks.number(k, v, 0.0, math.inf),
    "top_p": lambda k, v: checks.number(k, v, 0.0, 1.0, lo_open=True),
    "top_k": lambda k, v: checks.integer(k, v, -1, INT32_MAX),
    "min_p": lambda k, v: checks.number(k, v, 0.0, 1.0),
    "seed": lambda k, v: checks.optional_integer(k, v, INT64_MIN, INT64_MAX),
    "stop": lambda k, v: checks.strings(k, v, max_len=MAX_STOP_STRINGS, max_chars=MAX_STOP_CHARS),
    "stop_token_ids": lambda k, v: checks.integers(k, v, 0, INT32_MAX, max_len=MAX_STOP_TOKEN_IDS),
    "ignore_eos": checks.boolean,
    "logprobs": _logprobs,
    "skip_special_tokens": checks.boolean,
    "include_stop_str_in_output": checks.boolean,
}
_NULLABLE = frozenset({"max_tokens", "seed", "logprobs"})


@dataclass
class SamplingParams:
    """Per-request sampling settings, with vLLM's defaults and meanings."""

    max_tokens: int | None = None  # None: fill the context window
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token plus top-k alternatives
    # Each prompt token's logprob (plus top-k alternatives), as vLLM's ``prompt_logprobs``. Only the
    # completions route sets it (for ``echo``); the key in a ``sampling_params`` dict stays ignored.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @classmethod
    def from_dict(cls, raw: Any) -> SamplingParams:
        """Check a vLLM-style ``sampling_params`` field by field (null means "default"). Unknown keys,
        and neutral-only keys at another value, are refused rather than ignored: sampling from
        another distribution than asked for would corrupt a training run unnoticed."""
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise checks.bad(f"sampling_params must be a JSON object, got {checks.shown(raw)}")
        params = cls()
        for key, value in raw.items():
            if key == "n" or key in _IGNORED_KEYS or (value is None and key not in _NULLABLE):
                continue  # n (samples per prompt) is the route's business, not a sampling knob
            if key in _NEUTRAL_KEYS:
                if value != _NEUTRAL_KEYS[key] and value != [] and value != {}:
                    raise checks.bad(
                        f"sampling param {key}={checks.shown(value)} is not supported by the CPU "
                        f"inference server; leave it at {_NEUTRAL_KEYS[key]!r}"
                    )
                continue
            check = _CHECKS.get(key)
            if check is None:
                raise checks.bad(f"unknown sampling param {checks.shown(key)}; supported: {sorted(_CHECKS)}")
            setattr(params, key, check(key, value))
        if params.max_tokens is not None and params.min_tokens > params.max_tokens:
            raise checks.bad(f"min_tokens ({params.min_tokens}) exceeds max_tokens ({params.max_tokens})")
        params.top_k = max(params.top_k, 0)
        if params.seed == -1:
            params.seed = None  # vLLM: -1 means unseeded
        if 0.0 < params.temperature < MIN_TEMPERATURE:
            params.temperature = MIN_TEMPERATURE
        return params


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None


class BatchSampler:
    """One token per row with per-row settings. Draws invert each row's CDF at one uniform number
    (``searchsorted``): exact, and much cheaper on CPU than ``multinomial`` or an exponential race
    over the whole vocabulary. Seeded rows take their uniform from their own generator, so a seeded
    request reproduces whatever it is batched with."""

    def __init__(
        self,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        rng: torch.Generator,
        generated: list[int],
        stop_ids: list[frozenset[int]],
    ):
        self.params = params
        self.generators = generators
        self.rng = rng
        temps = [p.temperature for p in params]
        self.greedy = torch.tensor([t == 0.0 for t in temps])
        self.all_greedy = bool(self.greedy.all())
        self.any_greedy = bool(self.greedy.any())
        self.temperature = torch.tensor([t if t > 0 else 1.0 for t in temps]).unsqueeze(1)
        self.scale = any(t not in (0.0, 1.0) for t in temps)
        self.top_k = torch.tensor([p.top_k for p in params])
        self.top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
        self.min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
        self.use_top_k = bool((self.top_k > 0).any())
        self.use_top_p = bool((self.top_p < 1).any())
        self.use_min_p = bool((self.min_p > 0).any())
        self.seeded = [i for i, g in enumerate(generators) if g is not None]
        self.max_top = max((p.logprobs or 0) for p in params)
        # min_tokens: stop tokens are banned for a row while it has fewer than min_tokens tokens.
        self.generated = torch.tensor(generated)
        self.min_tokens = torch.tensor([p.min_tokens for p in params])
        self.steps_with_bans = int((self.min_tokens - self.generated).max()) if params else 0
        self.stop_ids = stop_ids
        self.stop_mask: torch.Tensor | None = None

    def sample(self, logits: torch.Tensor) -> SampleResult:
        """Draw one token per row of ``logits`` ([B, V], fp32)."""
        scaled = logits / self.temperature if self.scale else logits
        logprobs = torch.log_softmax(scaled, dim=-1)
        draw_from = logprobs
        if self.steps_with_bans > 0:
            banned = self._stop_mask(logits.shape[-1]) & (self.generated < self.min_tokens).unsqueeze(1)
            draw_from = logprobs.masked_fill(banned, float("-inf"))
            self.steps_with_bans -= 1
        self.generated += 1
        if self.all_greedy:
            tokens = draw_from.argmax(dim=-1)
        else:
            tokens = self._draw(draw_from)
            if self.any_greedy:
                tokens = torch.where(self.greedy, draw_from.argmax(dim=-1), tokens)
        chosen = reportable(logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1))
        top = None
        if self.max_top > 0:
            values, indices = logprobs.topk(self.max_top, dim=-1)
            rows = zip(indices.tolist(), reportable(values).tolist(), self.params, strict=True)
            top = [list(zip(i, v, strict=True))[: p.logprobs or 0] for i, v, p in rows]
        return SampleResult(tokens.tolist(), chosen.tolist(), top)

    def _stop_mask(self, vocab: int) -> torch.Tensor:
        if self.stop_mask is None:
            self.stop_mask = torch.zeros((len(self.params), vocab), dtype=torch.bool)
            for row, ids in enumerate(self.stop_ids):
                self.stop_mask[row, [t for t in ids if 0 <= t < vocab]] = True
        return self.stop_mask

    def _draw(self, logprobs: torch.Tensor) -> torch.Tensor:
        if self.use_top_k or self.use_top_p or self.use_min_p:
            logprobs = self._truncate(logprobs)
        cdf = logprobs.exp().cumsum(dim=-1)
        uniform = torch.rand((cdf.shape[0], 1), generator=self.rng)
        if self.seeded:  # one assignment: a row at a time costs 8 us each
            uniform[self.seeded] = torch.cat(
                [torch.rand(1, generator=self.generators[r]) for r in self.seeded]
            )[:, None]
        tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
        return tokens.clamp_(max=cdf.shape[-1] - 1)

    def _truncate(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Mask tokens outside each row's top-k / nucleus / min-p set (at least one survives)."""
        sorted_lp, order = logprobs.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_lp, dtype=torch.bool)
        ranks = torch.arange(sorted_lp.shape[-1]).unsqueeze(0)
        if self.use_top_k:
            k = torch.where(self.top_k > 0, self.top_k, sorted_lp.shape[-1]).unsqueeze(1)
            drop |= ranks >= k
        if self.use_top_p or self.use_min_p:
            sorted_p = sorted_lp.exp()
            if self.use_top_p:
                mass_before = sorted_p.cumsum(dim=-1) - sorted_p
                drop |= mass_before >= self.top_p
            if self.use_min_p:
                drop |= sorted_p < self.min_p * sorted_p[:, :1]
        drop[:, 0] = False
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        return torch.empty_like(logprobs).scatter_(1, order, sorted_lp)


def reportable(logprobs: torch.Tensor) -> torch.Tensor:
    """Logprobs as they go out: finite, floored at ``LOGPROB_FLOOR`` (JSON has no -inf or NaN)."""
    return torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
