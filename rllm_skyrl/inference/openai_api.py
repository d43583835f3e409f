"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (non-streaming).

Agent harnesses talk to the policy through these. Sampling keys follow vLLM's OpenAI server
(``top_k``, ``min_p``, ``stop_token_ids``, ``return_token_ids``...); keys that only shape the
transport (``user``, ``stream_options``...) are ignored. A request's own ``chat_template`` is
refused, as vLLM does unless started with ``--trust-request-chat-template``. With ``tools``, a
reply's calls come back as OpenAI ``tool_calls``, read by the model's template convention
(``tool_calls.py``), as vLLM does with ``--enable-auto-tool-choice``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from itertools import accumulate
from typing import Any

from rllm_skyrl.inference import checks, tool_calls
from rllm_skyrl.inference.checks import INT32_MAX
from rllm_skyrl.inference.errors import ApiError
from rllm_skyrl.inference.generation_request import GenerationResult
from rllm_skyrl.inference.sampling import MAX_TOP_LOGPROBS, SamplingParams
from rllm_skyrl.inference.served_model import InferenceService

MAX_CHOICES = 128  # n per prompt; each choice is a request of its own in the scheduler

_SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
)


def _sampling_params(body: dict[str, Any], logprobs: int | None, fewest: int = 1) -> SamplingParams:
    """``fewest`` is the least ``max_tokens`` allowed: 0 for an echo, which may generate nothing."""
    if flag(body, "stream"):
        raise ApiError(400, "stream=true is not supported by the CPU inference server; send stream=false")
    raw = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
    for key in ("max_completion_tokens", "max_tokens"):
        checks.optional_integer(key, body.get(key), fewest, INT32_MAX)
    limit = body.get("max_completion_tokens")
    raw["max_tokens"] = limit if limit is not None else body.get("max_tokens")
    raw["logprobs"] = logprobs
    return SamplingParams.from_dict(raw)


def num_choices(body: dict[str, Any]) -> int:
    return checks.optional_integer("n", body.get("n"), 1, MAX_CHOICES) or 1


def flag(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    return default if value is None else checks.boolean(key, value)


def n_jobs(prompt_ids: list[int], params: SamplingParams, n: int) -> list[tuple[list[int], SamplingParams]]:
    """n independent samples; with a seed, sample i uses seed + i so they differ yet reproduce."""
    if params.seed is None:
        return [(prompt_ids, params)] * n
    return [(prompt_ids, replace(params, seed=params.seed + i)) for i in range(n)]


def _usage(prompt_tokens: int, results: list[GenerationResult]) -> dict[str, int]:
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


async def chat_completion(service: InferenceService, body: dict[str, Any]) -> dict[str, Any]:
    """Everything is checked before the chat is templated, so a bad field costs no work."""
    adapter = service.resolve_model(checks.optional_string("model", body.get("model")))
    if body.get("chat_template") is not None:
        raise ApiError(
            400,
            "a request's own chat_template is not accepted: the server renders with the model's chat "
            "template; drop the field",
        )
    top = checks.optional_integer("top_logprobs", body.get("top_logprobs"), 0, MAX_TOP_LOGPROBS) or 0
    params = _sampling_params(body, top if flag(body, "logprobs") else None)
    n = num_choices(body)
    return_token_ids = flag(body, "return_token_ids")
    read_calls = tool_calls.wants_calls(body, tool_calls.template_convention(service.tokenizer.chat_template))
    prompt_ids = await service.render_chat(
        body.get("messages"),
        tools=body.get("tools"),
        add_generation_prompt=flag(body, "add_generation_prompt", default=True),
        continue_final_message=flag(body, "continue_final_message"),
        chat_template_kwargs=body.get("chat_template_kwargs"),
    )
    results = await service.generate_many(n_jobs(prompt_ids, params, n), adapter)
    choices = []
    for index, result in enumerate(results):
        text = service.output_text(result, params)
        message = tool_calls.openai_message(text) if read_calls else {"role": "assistant", "content": text}
        # vLLM's reason for a reply that ended to call tools
        called = bool(message.setdefault("tool_calls", [])) and result.finish_reason == "stop"
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "finish_reason": "tool_calls" if called else result.finish_reason,
            "stop_reason": result.stop_reason,
            "logprobs": logprobs_content(result, partial(_chat_entry, service)),
        }
        if return_token_ids:
            choice["token_ids"] = result.token_ids
        choices.append(choice)
    response = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or service.served_model_name,
        "choices": choices,
        "usage": _usage(len(prompt_ids), results),
    }
    if return_token_ids:
        response["prompt_token_ids"] = prompt_ids
    return response


def logprobs_content(
    result: GenerationResult, entry: Callable[[int, float], dict[str, Any]]
) -> dict[str, Any] | None:
    """vLLM's chat ``logprobs``, each token (sampled or top) rendered by ``entry(token, logprob)``."""
    if result.logprobs is None:
        return None
    tops = result.top_logprobs or [[] for _ in result.token_ids]
    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(tt, v) for tt, v in top]}
            for t, lp, top in zip(result.token_ids, result.logprobs, tops, strict=True)
        ]
    }


def _chat_entry(service: InferenceService, token: int, logprob: float) -> dict[str, Any]:
    piece = service.tokenizer.decode([token])
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}


async def _prompts(service: InferenceService, prompt: Any) -> list[list[int]]:
    """A completion ``prompt``: a string, a token list, or a non-empty list of either (flat)."""
    return [ids for ids, _ in await _prompt_items(service, prompt, with_text=False)]


async def _prompt_items(
    service: InferenceService, prompt: Any, with_text: bool
) -> list[tuple[list[int], str]]:
    """Each prompt's token ids and, ``with_text``, its text: a token prompt's decoded, as vLLM echoes it."""
    items = [prompt] if isinstance(prompt, str) or (isinstance(prompt, list) and _is_ids(prompt)) else prompt
    if not isinstance(items, list) or not items or not all(isinstance(p, str) or _is_ids(p) for p in items):
        raise ApiError(400, "prompt must be a string, a list of token ids, or a non-empty list of those")
    out = []
    for p in items:
        if isinstance(p, str):
            out.append((await service.encode(p), p))
        else:
            out.append((p, await service.decode(p) if with_text else ""))
    return out


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(checks.is_int(t) for t in value)


async def completion(service: InferenceService, body: dict[str, Any]) -> dict[str, Any]:
    """With ``echo`` (as vLLM's server): the text and logprobs start with the prompt's, the first
    prompt token's logprob None; ``max_tokens=0`` echoes the prompt alone (vLLM generates one token
    and drops it, ``finish_reason="length"``; so does this)."""
    if body.get("suffix"):
        raise ApiError(400, "suffix is not supported by the CPU inference server; drop the field")
    adapter = service.resolve_model(checks.optional_string("model", body.get("model")))
    echo = flag(body, "echo")
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    echo_only = echo and checks.is_int(limit) and limit == 0
    capped = {**body, "max_tokens": 1, "max_completion_tokens": None} if echo_only else body
    params = _sampling_params(capped, body.get("logprobs"), 0 if echo else 1)
    if echo and params.logprobs is not None:
        params = replace(params, prompt_logprobs=params.logprobs)
    n = num_choices(body)
    return_token_ids = flag(body, "return_token_ids")
    prompts = await _prompt_items(service, body.get("prompt"), with_text=echo)
    jobs = [job for ids, _ in prompts for job in n_jobs(ids, params, n)]
    results = await service.generate_many(jobs, adapter)
    if echo_only:  # the one token generated to score the prompt is not part of the answer
        results = [
            replace(r, token_ids=[], logprobs=None if r.logprobs is None else [], top_logprobs=None)
            for r in results
        ]
    choices = []
    for index, result in enumerate(results):  # prompt by prompt, n choices each
        prompt_ids, prompt_text = prompts[index // n]
        text = service.output_text(result, params)
        choice: dict[str, Any] = {
            "index": index,
            "text": prompt_text + text if echo else text,
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
            "logprobs": _completion_logprobs(service, result, prompt_ids if echo else None),
        }
        if return_token_ids:
            choice["token_ids"] = result.token_ids
            choice["prompt_token_ids"] = prompt_ids
        choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or service.served_model_name,
        "choices": choices,
        "usage": _usage(sum(len(ids) for ids, _ in prompts) * n, results),
    }


def _completion_logprobs(
    service: InferenceService, result: GenerationResult, echoed: list[int] | None
) -> dict[str, Any] | None:
    """vLLM's completion ``logprobs``; with ``echoed`` (the prompt's ids), the prompt's tokens first."""
    if result.logprobs is None:
        return None
    token_ids, logprobs, tops = result.token_ids, list(result.logprobs), result.top_logprobs
    if echoed is not None:
        scored = result.prompt_logprobs
        if scored is None:  # aborted (a pause) before its prefill
            raise ApiError(
                503, f"the request ended ({result.finish_reason}) before its prompt was scored; retry"
            )
        token_ids = [*echoed, *token_ids]
        logprobs = [*scored.logprobs, *logprobs]
        tops = None if scored.top is None else [*scored.top, *(tops or [])]
    pieces = [service.tokenizer.decode([t]) for t in token_ids]
    return {
        "tokens": pieces,
        "token_logprobs": logprobs,
        "top_logprobs": (
            [None if top is None else {service.tokenizer.decode([t]): v for t, v in top} for top in tops]
            if tops is not None
            else None
        ),
        "text_offset": list(accumulate((len(p) for p in pieces), initial=0))[:-1],  # where each piece starts
    }
