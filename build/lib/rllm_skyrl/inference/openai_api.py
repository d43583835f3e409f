"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (non-streaming).

Agent harnesses talk to the policy through these. Sampling keys follow vLLM's OpenAI server
(``top_k``, ``min_p``, ``min_tokens``, ``stop_token_ids``, ``return_token_ids``... are accepted);
request keys that only shape the transport (``user``, ``stream_options``...) are ignored.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from rllm_skyrl.inference.errors import ApiError
from rllm_skyrl.inference.sampling import SamplingParams
from rllm_skyrl.inference.scheduler import GenerationResult
from rllm_skyrl.inference.service import InferenceService

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
    if body.get("stream"):
        raise ApiError(400, "stream=true is not supported by the CPU inference server; send stream=false")
    raw = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
    raw["max_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens")
    raw["logprobs"] = logprobs
    return SamplingParams.from_dict(raw)


def _num_choices(body: dict[str, Any]) -> int:
    n = body.get("n") or 1
    if not isinstance(n, int) or n < 1:
        raise ApiError(400, f"n must be a positive integer, got {n!r}")
    return n


async def _sample_n(
    service: InferenceService, prompt_ids: list[int], params: SamplingParams, n: int, adapter: str | None
) -> list[GenerationResult]:
    """n independent samples; with a seed, sample i uses seed + i so they differ yet reproduce."""
    per_sample = [params]
    for i in range(1, n):
        extra = SamplingParams(**vars(params))
        extra.seed = None if params.seed is None else params.seed + i
        per_sample.append(extra)
    return list(await asyncio.gather(*(service.generate(prompt_ids, p, adapter) for p in per_sample)))


def _usage(prompt_tokens: int, results: list[GenerationResult]) -> dict[str, int]:
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def _piece(service: InferenceService, token: int) -> str:
    return service.tokenizer.decode([token])


async def chat_completion(service: InferenceService, body: dict[str, Any]) -> dict[str, Any]:
    adapter = service.resolve_model(body.get("model"))
    prompt_ids = service.render_chat(
        body.get("messages"),
        tools=body.get("tools"),
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        chat_template_kwargs=body.get("chat_template_kwargs"),
    )
    top = body.get("top_logprobs") or 0
    params = _sampling_params(body, top if body.get("logprobs") else None)
    results = await _sample_n(service, prompt_ids, params, _num_choices(body), adapter)
    choices = []
    for index, result in enumerate(results):
        choice: dict[str, Any] = {
            "index": index,
            "message": {
                "role": "assistant",
                "content": service.output_text(result, params),
                "tool_calls": [],
            },
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
            "logprobs": _chat_logprobs(service, result),
        }
        if body.get("return_token_ids"):
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
    if body.get("return_token_ids"):
        response["prompt_token_ids"] = prompt_ids
    return response


def _chat_logprobs(service: InferenceService, result: GenerationResult) -> dict[str, Any] | None:
    if result.logprobs is None:
        return None
    tops = result.top_logprobs or [[] for _ in result.token_ids]

    def entry(token: int, logprob: float) -> dict[str, Any]:
        piece = _piece(service, token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(tt, v) for tt, v in top]}
            for t, lp, top in zip(result.token_ids, result.logprobs, tops, strict=True)
        ]
    }


def _prompts(service: InferenceService, prompt: Any) -> list[list[int]]:
    """A completion ``prompt``: a string, a token list, or a list of either."""
    if isinstance(prompt, str):
        return [service.tokenizer.encode(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return [p for item in prompt for p in _prompts(service, item)]
    raise ApiError(400, "prompt must be a string, a list of token ids, or a non-empty list of those")


async def completion(service: InferenceService, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("echo") or body.get("suffix"):
        raise ApiError(400, "echo and suffix are not supported by the CPU inference server")
    adapter = service.resolve_model(body.get("model"))
    prompts = _prompts(service, body.get("prompt"))
    params = _sampling_params(body, body.get("logprobs"))
    n = _num_choices(body)
    batches = await asyncio.gather(*(_sample_n(service, p, params, n, adapter) for p in prompts))
    choices = []
    for p_index, results in enumerate(batches):
        for j, result in enumerate(results):
            choice: dict[str, Any] = {
                "index": p_index * n + j,
                "text": service.output_text(result, params),
                "finish_reason": result.finish_reason,
                "stop_reason": result.stop_reason,
                "logprobs": _completion_logprobs(service, result),
            }
            if body.get("return_token_ids"):
                choice["token_ids"] = result.token_ids
                choice["prompt_token_ids"] = prompts[p_index]
            choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model") or service.served_model_name,
        "choices": choices,
        "usage": _usage(sum(len(p) for p in prompts) * n, [r for b in batches for r in b]),
    }


def _completion_logprobs(service: InferenceService, result: GenerationResult) -> dict[str, Any] | None:
    if result.logprobs is None:
        return None
    pieces = [_piece(service, t) for t in result.token_ids]
    offsets, offset = [], 0
    for piece in pieces:
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": pieces,
        "token_logprobs": result.logprobs,
        "top_logprobs": (
            [{_piece(service, t): v for t, v in top} for top in result.top_logprobs]
            if result.top_logprobs is not None
            else None
        ),
        "text_offset": offsets,
    }
