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


def _sampling_params(body: dict[str, Any], logprobs: int | None) -> SamplingParams:
    if flag(body, "stream"):
        raise ApiError(400, "stream=true is not supported by the CPU inference server; send stream=false")
    raw = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
    for key in ("max_completion_tokens", "max_tokens"):
        checks.optional_integer(key, body.get(key), 1, INT32_MAX)
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
    items = [prompt] if isinstance(prompt, str) or (isinstance(prompt, list) and _is_ids(prompt)) else prompt
    if not isinstance(items, list) or not items or not all(isinstance(p, str) or _is_ids(p) for p in items):
        raise ApiError(400, "prompt must be a string, a list of token ids, or a non-empty list of those")
    return [await service.encode(p) if isinstance(p, str) else p for p in items]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(checks.is_int(t) for t in value)


async def completion(service: InferenceService, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("echo") or body.get("suffix"):
        raise ApiError(400, "echo and suffix are not supported by the CPU inference server")
    adapter = service.resolve_model(checks.optional_string("model", body.get("model")))
    params = _sampling_params(body, body.get("logprobs"))
    n = num_choices(body)
    return_token_ids = flag(body, "return_token_ids")
    prompts = await _prompts(service, body.get("prompt"))
    results = await service.generate_many([job for p in prompts for job in n_jobs(p, params, n)], adapter)
    choices = []
    for index, result in enumerate(results):  # prompt by prompt, n choices each
        choice: dict[str, Any] = {
            "index": index,
            "text": service.output_text(result, params),
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
            "logprobs": _completion_logprobs(service, result),
        }
        if return_token_ids:
            choice["token_ids"] = result.token_ids
            choice["prompt_token_ids"] = prompts[index // n]
        choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or service.served_model_name,
        "choices": choices,
        "usage": _usage(sum(len(p) for p in prompts) * n, results),
    }


def _completion_logprobs(service: InferenceService, result: GenerationResult) -> dict[str, Any] | None:
    if result.logprobs is None:
        return None
    pieces = [service.tokenizer.decode([t]) for t in result.token_ids]
    return {
        "tokens": pieces,
        "token_logprobs": result.logprobs,
        "top_logprobs": (
            [{service.tokenizer.decode([t]): v for t, v in top} for top in result.top_logprobs]
            if result.top_logprobs is not None
            else None
        ),
        "text_offset": list(accumulate((len(p) for p in pieces), initial=0))[:-1],  # where each piece starts
    }
