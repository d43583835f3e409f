"""HTTP routes: the endpoints SkyRL's ``RemoteInferenceClient`` calls, with vLLM's payloads, plus ours.

| route | who calls it |
|---|---|
| ``POST /inference/v1/generate`` | ``RemoteInferenceClient.generate`` / ``sample`` (token ids in and out) |
| ``POST /v1/chat/completions``, ``/v1/completions`` | ``chat_completion`` / ``completion``, agent harnesses |
| ``POST /tokenize``, ``/detokenize`` | the client when it has no local tokenizer |
| ``POST /pause?mode=&clear_cache=``, ``/resume`` | weight sync |
| ``POST /sleep?level=&tags=``, ``/wake_up?tags=``, ``GET /is_sleeping`` | colocated training |
| ``POST /reset_prefix_cache``, ``GET /get_world_size`` | weight sync, start-up |
| ``POST /skyrl/v1/load_lora_adapter``, ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` | LoRA sync |
| ``POST /rllm_skyrl/v1/load_weights``, ``GET /rllm_skyrl/v1/weight_version`` | full-weight sync on CPU |

Errors are ``{"error": {"message", "type", "code"}}``, which the client surfaces verbatim. Every
field is checked before any work starts; a request whose client disconnects is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rllm_skyrl.inference import checks, openai_api
from rllm_skyrl.inference.checks import INT64_MAX
from rllm_skyrl.inference.errors import ApiError
from rllm_skyrl.inference.generation_request import GenerationResult
from rllm_skyrl.inference.middleware import BodyLimit, LastResortErrors, TokenAuth
from rllm_skyrl.inference.sampling import SamplingParams
from rllm_skyrl.inference.served_model import InferenceService

MAX_DETOKENIZE = 1 << 20

SLEEP_TAGS = ("weights", "kv_cache")
# SkyRL's GPU weight-transfer routes; on CPU the trainer writes HF weights and calls ours instead.
_GPU_ONLY_ROUTES = (
    "/update_weights",
    "/fetch_weights",
    "/collective_rpc",
    "/start_weight_update",
    "/finish_weight_update",
    "/init_weight_transfer_engine",
    "/skyrl/v1/generate",
)


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        content=orjson.dumps(payload), status_code=status, media_type="application/json", headers=headers
    )


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def token_logprobs(result: GenerationResult) -> dict[str, Any] | None:
    """vLLM's ``logprobs`` for token-in/token-out responses (tokens named ``token_id:N``)."""
    return openai_api.logprobs_content(result, lambda t, lp: {"token": f"token_id:{t}", "logprob": lp})


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone; call only after the body was read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected[T](request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (and so its requests in the scheduler) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ApiError(499, "the client disconnected; its request was cancelled")  # nobody reads this
    return task.result()


def build_app(
    service: InferenceService, *, token: str | None = None, max_body_bytes: int = 16 << 20
) -> FastAPI:
    app = FastAPI(title="rllm_skyrl CPU inference server", docs_url=None, redoc_url=None)
    scheduler = service.scheduler
    # add_middleware wraps outwards: the token is checked first, LastResortErrors sits innermost.
    app.add_middleware(LastResortErrors)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if token is not None:
        app.add_middleware(TokenAuth, token=token)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return json_response(exc.body(), exc.status, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return json_response(ApiError(exc.status_code, str(exc.detail)).body(), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _query_error(_: Request, exc: RequestValidationError) -> Response:
        # vLLM answers malformed parameters with 400, not FastAPI's 422.
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return json_response(ApiError(400, f"invalid request: {problems}").body(), 400)

    # ------------------------------------------------------------------ data plane
    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        token_ids = body.get("token_ids")
        if not isinstance(token_ids, list):
            raise ApiError(400, "'token_ids' (a list of prompt token ids) is required")
        if body.get("features"):
            raise ApiError(400, "multi-modal features are not supported by the CPU inference server")
        request_id = checks.optional_string("request_id", body.get("request_id"))
        raw_params = body.get("sampling_params")
        params = SamplingParams.from_dict(raw_params)
        # n samples of one prompt (SkyRL's client asks for them through its Tinker-style `sample`).
        n = openai_api.num_choices(raw_params or {})  # from_dict refused anything but an object or null
        adapter = service.resolve_model(checks.optional_string("model", body.get("model")))
        jobs = openai_api.n_jobs(token_ids, params, n)
        results = await unless_disconnected(request, service.generate_many(jobs, adapter))
        choices = [
            {
                "index": index,
                "token_ids": result.token_ids,
                "finish_reason": result.finish_reason,
                "stop_reason": result.stop_reason,
                "logprobs": token_logprobs(result),
            }
            for index, result in enumerate(results)
        ]
        return json_response({"request_id": request_id or f"gen-{uuid.uuid4().hex}", "choices": choices})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request)
        return json_response(await unless_disconnected(request, openai_api.chat_completion(service, body)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request)
        return json_response(await unless_disconnected(request, openai_api.completion(service, body)))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await read_json(request)
        if "messages" in body:
            tokens = await service.render_chat(body["messages"], tools=body.get("tools"))
        elif isinstance(body.get("prompt"), str):
            special = openai_api.flag(body, "add_special_tokens", default=True)
            tokens = await service.encode(body["prompt"], add_special_tokens=special)
        else:
            raise ApiError(400, "send 'prompt' (a string) or 'messages' (a chat) to tokenize")
        if len(tokens) > service.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {service.max_model_len} tokens; the text has more",
            )
        return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": service.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await read_json(request)
        if body.get("tokens") is None:
            raise ApiError(400, "'tokens' (a list of token ids) is required")
        tokens = checks.integers(
            "tokens", body["tokens"], 0, scheduler.vocab_size - 1, max_len=MAX_DETOKENIZE
        )
        return json_response({"prompt": await service.decode(tokens)})

    # ------------------------------------------------------------------ info
    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"object": "model", "owned_by": "rllm_skyrl", "max_model_len": service.max_model_len}
        data = [{**card, "id": service.served_model_name, "root": service.model_dir, "parent": None}]
        data += [
            {**card, "id": name, "root": name, "parent": service.served_model_name}
            for name in scheduler.lora.names
        ]
        return json_response({"object": "list", "data": data})

    @app.get("/get_world_size")
    async def world_size() -> Response:
        return json_response({"world_size": 1})

    @app.get("/rllm_skyrl/v1/weight_version")
    async def weight_version() -> Response:
        return json_response(
            {"weight_version": scheduler.weight_version, "path": service.weights_path or service.model_dir}
        )

    @app.get("/rllm_skyrl/v1/stats")
    async def stats() -> Response:
        return json_response(
            {
                "running": scheduler.num_running,
                "waiting": scheduler.num_waiting,
                "paused": scheduler.paused,
                "sleeping": sorted(scheduler.sleeping_tags),
                "counters": dict(scheduler.counters),
            }
        )

    # ------------------------------------------------------------------ control plane
    @app.post("/pause")
    async def pause(mode: str = "keep") -> Response:
        # clear_cache is accepted and ignored: there is no prefix cache to clear.
        await asyncio.wrap_future(scheduler.pause(mode.lower()))
        return json_response({"status": "paused", "mode": mode.lower()})

    @app.post("/resume")
    async def resume() -> Response:
        await asyncio.wrap_future(scheduler.resume())
        return json_response({"status": "resumed"})

    @app.post("/sleep")
    async def sleep(request: Request, level: int = 1) -> Response:
        if level not in (1, 2):
            raise ApiError(400, f"sleep level must be 1 or 2, got {level}")
        tags = request.query_params.getlist("tags") or list(SLEEP_TAGS)
        await service.sleep(tags)
        return json_response({"status": "sleeping", "tags": tags})

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        await service.wake_up(tags)
        return json_response({"status": "awake", "sleeping": sorted(scheduler.sleeping_tags)})

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return json_response({"is_sleeping": bool(scheduler.sleeping_tags)})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        # No prefix cache: only the samples of one admission share a prefill.
        return json_response({"status": "ok"})

    async def _load_lora(request: Request) -> Response:
        body = await read_json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError(400, "'lora_name' and 'lora_path' are required (in-memory adapters need vLLM)")
        await service.load_lora(name, path)
        return json_response({"status": "ok", "lora_name": name})

    app.post("/skyrl/v1/load_lora_adapter")(_load_lora)
    app.post("/v1/load_lora_adapter")(_load_lora)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
            raise ApiError(400, "'lora_name' is required")
        await service.unload_lora(body["lora_name"])
        return json_response({"status": "ok", "lora_name": body["lora_name"]})

    @app.post("/rllm_skyrl/v1/load_weights")
    async def load_weights(request: Request) -> Response:
        body = await read_json(request)
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise ApiError(400, "'path' (a directory written by save_pretrained) is required")
        version = checks.optional_integer("weight_version", body.get("weight_version"), 0, INT64_MAX)
        return json_response(await service.load_weights(path, version))

    async def _gpu_only(request: Request) -> Response:
        raise ApiError(
            501,
            f"{request.url.path} needs SkyRL's vLLM servers; on the CPU server write the weights with "
            "save_pretrained and POST /rllm_skyrl/v1/load_weights {'path', 'weight_version'}",
        )

    for route in _GPU_ONLY_ROUTES:
        app.post(route)(_gpu_only)

    return app
