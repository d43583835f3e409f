"""The sampling params and the seed of one rollout request.

With a base seed (``request_seed``), each request's seed derives from what is asked and when in
training (``RequestSeeds``), so a run resumed from a checkpoint samples what the uninterrupted one did.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from typing import Any

logger = logging.getLogger(__name__)

# Per-call keyword arguments that become sampling params (vLLM names).
SAMPLING_KEYS = frozenset(
    "temperature top_p top_k min_p seed stop stop_token_ids min_tokens logprobs ignore_eos"
    " include_stop_str_in_output skip_special_tokens repetition_penalty presence_penalty"
    " frequency_penalty".split()
)
# Keyword arguments rLLM workflows pass that are not sampling params; consumed or ignored here.
WORKFLOW_KEYS = frozenset({"application_id", "session_id", "reasoning_effort"})
DEFAULT_SAMPLING_PARAMS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": 0}


def request_params(
    defaults: dict[str, Any], kwargs: dict[str, Any], max_response_length: int, warned: set[str]
) -> dict[str, Any]:
    """The run's train or validation params with the call's sampling keywords on top, ``max_tokens``
    capped; other keywords are logged once each (``warned``)."""
    params = dict(defaults)
    max_tokens, max_new_tokens = kwargs.pop("max_tokens", None), kwargs.pop("max_new_tokens", None)
    requested = max_tokens or max_new_tokens or params.get("max_tokens")
    for key, value in kwargs.items():
        if key in SAMPLING_KEYS:
            params[key] = value
        elif key not in WORKFLOW_KEYS and key not in warned:
            warned.add(key)
            logger.warning("SkyRLEngine ignores the unknown keyword argument %r", key)
    if params.pop("n", 1) != 1:
        raise ValueError("n > 1 is not supported per call; run one rollout per sample instead")
    params["max_tokens"] = min(requested or max_response_length, max_response_length)
    return params


def hashed_seed(material: bytes) -> int:
    """A seed in ``[0, 2**62)``: counting up from it by a request's repeats stays a valid int64."""
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "big") >> 2


def continuation_seed(seed: int, produced: int) -> int:
    """The seed for resuming a request after an abort, ``produced`` tokens in: fresh numbers, still
    determined by the request's own seed."""
    return hashed_seed(f"{seed}:{produced}".encode())


# A rollout that asks the same prompt again counts up from here: clear of any task's rollout indices.
REPEAT_STRIDE = 2**20


class RequestSeeds:
    """A request's seed at the current weight version, the same in every run of the same config.

    With rLLM's rollout id (``application_id="{task_id}:{rollout_idx}"``), the ``k``-th rollout of a
    task gets ``base(task, prompt) + k``: whatever order concurrent tasks reach the server in, and
    even when two tasks share a prompt, each rollout samples what it did in another run. Without
    one, the ``k``-th request for a prompt gets ``base(prompt) + k`` in arrival order. Consecutive
    seeds are what one ``sample`` call for n completions carries, so seeding costs no batching. A
    prompt asked again within one rollout counts up from ``base + REPEAT_STRIDE``.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[int, bool, bytes, str | None], int] = {}
        self._version: int | None = None

    def next(
        self, base_seed: int, weight_version: int, prompt: list[int], validate: bool, rollout_id: Any = None
    ) -> int:
        if self._version != weight_version:
            self._counts.clear()
            self._version = weight_version
        digest = hashlib.sha256(array("q", prompt).tobytes()).digest()
        task, _, index = str(rollout_id).rpartition(":") if rollout_id is not None else ("", "", "")
        material = f"{base_seed}:{weight_version}:{int(validate)}:{task}:".encode() + digest
        indexed = index.isdigit()
        key = (weight_version, validate, digest, str(rollout_id) if indexed else None)
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        if indexed:
            return hashed_seed(material) + int(index) + count * REPEAT_STRIDE
        return hashed_seed(material) + count
