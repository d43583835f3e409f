"""Identical prompts sampled at the same time become one request for n samples.

rLLM rolls every task out n times at once: through SkyRL's client, n ``/inference/v1/generate``
requests with the same prompt, each followed by a ``/detokenize`` whose text the engine never reads.
Tinker's ``sample``, which SkyRL's client speaks and vLLM and this package's server serve, is one
request for ``num_samples`` completions and no detokenize. Only what it can carry is batched;
anything else gets ``None`` and the engine sends it alone. Seeded requests share a call when their
seeds count up one by one: completion ``i`` of a call seeded ``s`` samples with ``s + i`` (vLLM's
rule for ``n > 1``, followed by this package's server and Tinker), exactly what each would get alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

# Our (vLLM) sampling keys -> the keys of SkyRL's Tinker-style sample request.
_SAMPLE_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_tokens": "max_tokens",
    "seed": "seed",
    "stop": "stop_strings",
    "stop_token_ids": "stop_tokens",
}
# Keys ``sample`` does not carry but that are fine at these values (``logprobs``: it always asks for
# the sampled token's logprob).
_NEUTRAL = {"logprobs": (0, None), "n": (1, None)}
# Requests arriving within this many seconds of the first one with the same key share its call.
WINDOW_S = 0.002
# Samples per call: a full group is sent at once and the next caller starts a new one. This
# package's server serves at most 128 per request (inference.openai_api.MAX_CHOICES).
MAX_SAMPLES = 128


@dataclass
class _Pending:
    key: tuple  # where it waits in ``SampleBatcher._pending``: moves on with each seeded caller
    prompt: list[int]
    params: dict[str, Any]
    timer: asyncio.TimerHandle | None = None
    waiters: list[asyncio.Future] = field(default_factory=list)


def sample_params(params: dict[str, Any]) -> dict[str, Any] | None:
    """The Tinker-style parameters for ``params``, or None when ``sample`` cannot carry them."""
    out = {}
    for key, value in params.items():
        if key in _SAMPLE_KEYS:
            if value is not None and not (key == "seed" and value == -1):  # vLLM's -1: unseeded
                out[_SAMPLE_KEYS[key]] = value
        elif value not in _NEUTRAL.get(key, ()):
            return None
    return out


class SampleBatcher:
    """Gathers concurrent identical requests per client and sends each group as one ``sample``."""

    def __init__(self, model: str | None = None, max_samples: int = MAX_SAMPLES) -> None:
        self.model = model
        self.max_samples = max_samples
        self._pending: dict[tuple, _Pending] = {}
        self.requests_sent = 0  # sample calls made (each serving one or more callers)

    async def sample(self, client: Any, prompt: list[int], params: dict[str, Any]):
        """``(token_ids, logprobs, stop_reason)`` of one completion, or None if not batchable."""
        tinker = sample_params(params)
        if tinker is None:
            return None
        seed = tinker.get("seed")
        shared = tuple(sorted((k, repr(v)) for k, v in tinker.items() if k != "seed"))
        key = (id(client), tuple(prompt), shared, seed)  # a seeded caller joins where its seed is next
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        pending = self._pending.pop(key, None)
        if pending is None:
            pending = _Pending(key, list(prompt), tinker)
            pending.timer = loop.call_later(WINDOW_S, self._send, pending, client)
        if seed is not None:
            pending.key = (*key[:3], seed + 1)
        # Where a call already expects that next seed (this caller repeated one of its seeds), this
        # call takes no one else and goes at its time.
        self._pending.setdefault(pending.key, pending)
        pending.waiters.append(future)
        if len(pending.waiters) >= self.max_samples:
            pending.timer.cancel()
            self._send(pending, client)
        return await future

    def _send(self, pending: _Pending, client: Any) -> None:
        if self._pending.get(pending.key) is pending:
            del self._pending[pending.key]
        asyncio.get_running_loop().create_task(self._call(client, pending))

    async def _call(self, client: Any, pending: _Pending) -> None:
        self.requests_sent += 1
        body: dict[str, Any] = {
            "prompt": {"chunks": [{"tokens": pending.prompt}]},
            "num_samples": len(pending.waiters),
            "sampling_params": pending.params,
        }
        if self.model is not None:
            body["model"] = self.model
        try:
            response = await client.sample({"json": body})
        except BaseException as error:  # every caller of the batch sees the failure
            _fail(pending, error)
            if not isinstance(error, Exception):
                raise
            return
        sequences = response["sequences"]
        if len(sequences) != len(pending.waiters):
            error = RuntimeError(f"asked the server for {len(pending.waiters)} samples, got {len(sequences)}")
            _fail(pending, error)
            return
        for waiter, sequence in zip(pending.waiters, sequences, strict=True):
            if not waiter.done():
                waiter.set_result((sequence["tokens"], sequence["logprobs"], sequence["stop_reason"]))


def _fail(pending: _Pending, error: BaseException) -> None:
    for waiter in pending.waiters:
        if not waiter.done():
            waiter.set_exception(error)
