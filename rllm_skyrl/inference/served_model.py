"""The served model behind the HTTP routes (which translate HTTP to these calls).

Chat templating and text tokenization run on a thread of their own, never on the event loop: a
heavy template or a long text would otherwise stall every other request, ``/health`` included.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rllm_skyrl.inference.checks import shown
from rllm_skyrl.inference.errors import ApiError
from rllm_skyrl.inference.generation_request import GenerationResult
from rllm_skyrl.inference.sampling import SamplingParams
from rllm_skyrl.inference.scheduler import Scheduler
from rllm_skyrl.inference.weights import WeightsRoot, load_full_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# apply_chat_template's own arguments: a request may not set them through chat_template_kwargs
# (the template is the model's own; vLLM likewise refuses request templates by default).
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class InferenceService:
    """One HF causal LM plus tokenizer, served through a ``Scheduler``."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        max_batch_size: int = 256,
        max_waiting: int = 4096,
        dtype: str = "float32",
        seed: int = 0,
        weights_root: str | Path | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=_DTYPES[dtype])
        model.eval().requires_grad_(False)
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if max_model_len is not None and limit is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}; "
                "pass a value <= that limit or omit it"
            )
        self.max_model_len = int(max_model_len or limit or 2048)
        self.served_model_name = served_model_name or self.model_dir
        self.base_names = {self.served_model_name, self.model_dir, "default"}
        self.weights_root = WeightsRoot(weights_root)
        self.scheduler = Scheduler(
            model,
            self.tokenizer,
            max_model_len=self.max_model_len,
            max_batch_size=max_batch_size,
            max_waiting=max_waiting,
            seed=seed,
            can_merge=_full_attention_only(model.config.get_text_config()),
            weights_root=self.weights_root,
        )
        self.weights_path: str | None = None
        # One thread: HF fast tokenizers are not safe to encode with from several threads at once.
        self._text_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rllm-skyrl-templating")

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self._text_thread.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ data plane
    def resolve_model(self, name: str | None) -> str | None:
        """Map a request's ``model`` to a LoRA adapter name, or None for the base model."""
        if not name or name in self.base_names:
            return None
        if name in self.scheduler.lora.names:
            return name
        raise ApiError(
            404,
            f"The model {name!r} does not exist; served: {sorted(self.base_names)} "
            f"plus LoRA adapters {self.scheduler.lora.names}",
        )

    async def generate_many(
        self, jobs: list[tuple[list[int], SamplingParams]], adapter: str | None = None
    ) -> list[GenerationResult]:
        """Run ``(prompt_ids, params)`` jobs, queued all or none. If the awaiting task is cancelled
        (its client left) or one job fails, the others are cancelled too: nobody would read them."""
        if not jobs:
            return []
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        results: list[GenerationResult | None] = [None] * len(jobs)
        remaining = len(jobs)

        # Called on the generation thread, which finishes every row of a batch in one pass: the
        # loop is woken once per call (a failure at once), not once per sample.
        def record(index: int, outcome: GenerationResult | BaseException) -> None:
            nonlocal remaining
            if isinstance(outcome, BaseException):
                loop.call_soon_threadsafe(_settle, done, outcome)
                return
            results[index] = outcome
            remaining -= 1
            if remaining == 0:
                loop.call_soon_threadsafe(_settle, done, results)

        requests = self.scheduler.submit(
            [(prompt, params, partial(record, i)) for i, (prompt, params) in enumerate(jobs)], adapter=adapter
        )
        try:
            return list(await done)
        except BaseException:
            self.scheduler.cancel(requests)
            raise

    async def render_chat(
        self,
        messages: Any,
        *,
        tools: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Any = None,
    ) -> list[int]:
        """Template and tokenize a chat with the model's own template, off the event loop."""
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects")
        if tools is not None and not isinstance(tools, list):
            raise ApiError(400, f"tools must be a list of tool definitions, got {shown(tools)}")
        extra = chat_template_kwargs or {}
        if not isinstance(extra, dict):
            raise ApiError(400, f"chat_template_kwargs must be an object, got {shown(extra)}")
        if reserved := sorted(_RESERVED_TEMPLATE_KWARGS & set(extra)):
            raise ApiError(
                400,
                f"chat_template_kwargs may not set {reserved}: the server renders with the model's own "
                "chat template; pass template variables only (e.g. enable_thinking)",
            )

        def render() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(
                    messages,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt and not continue_final_message,
                    continue_final_message=continue_final_message,
                    **extra,
                )
            except Exception as exc:
                raise ApiError(400, f"the chat template rejected the messages: {exc}") from exc
            if not isinstance(text, str):
                raise ApiError(400, "the chat template did not render to text; check messages and tools")
            return self._encode(text, add_special_tokens=False)

        return await self._on_text_thread(render)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._on_text_thread(lambda: self._encode(text, add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._on_text_thread(lambda: self.tokenizer.decode(token_ids))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # Truncated one past the context window: a longer prompt is refused all the same, and a
        # huge text never becomes a huge Python list (whose building would hold the GIL).
        return self.tokenizer.encode(
            text, add_special_tokens=add_special_tokens, truncation=True, max_length=self.max_model_len + 1
        )

    async def _on_text_thread(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._text_thread, fn)

    def output_text(self, result: GenerationResult, params: SamplingParams) -> str:
        """Decoded completion, cut before a matched stop string unless asked to keep it."""
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=params.skip_special_tokens)
        if isinstance(result.stop_reason, str) and not params.include_stop_str_in_output:
            text = text.partition(result.stop_reason)[0]
        return text

    # ------------------------------------------------------------------ control plane
    async def on_thread(self, fn) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))

    async def load_weights(self, path: str, weight_version: int | None) -> dict[str, Any]:
        directory = self.weights_root.directory(path, "weights")
        if self.scheduler.lora.names:
            raise ApiError(
                409,
                f"LoRA adapters {self.scheduler.lora.names} are loaded; unload them "
                "(POST /v1/unload_lora_adapter) before loading full weights",
            )

        def load() -> dict[str, Any]:
            start = time.perf_counter()
            load_full_weights(self.scheduler.model, directory, self.weights_root)
            version = self.scheduler.weight_version + 1 if weight_version is None else int(weight_version)
            self.scheduler.weight_version = version
            self.weights_path = str(directory)
            return {
                "status": "ok",
                "weight_version": version,
                "seconds": round(time.perf_counter() - start, 4),
            }

        return await self.on_thread(load)

    async def load_lora(self, name: str, path: str) -> None:
        await self.on_thread(lambda: self.scheduler.lora.load(name, path))

    async def unload_lora(self, name: str) -> None:
        def unload() -> None:
            in_use = sum(1 for r in self.scheduler.running_rows() if r.adapter == name)
            if in_use:
                raise ApiError(
                    409,
                    f"LoRA adapter {name!r} is used by {in_use} running requests; "
                    "pause with mode=abort or wait for them before unloading",
                )
            self.scheduler.lora.unload(name)

        await self.on_thread(unload)

    async def sleep(self, tags: list[str]) -> None:
        await self.on_thread(lambda: self.scheduler.sleeping_tags.update(tags))

    async def wake_up(self, tags: list[str] | None) -> None:
        """Wake ``tags``, or everything when none are given."""
        sleeping = self.scheduler.sleeping_tags
        await self.on_thread(lambda: sleeping.difference_update(tags or list(sleeping)))


def _settle(future: asyncio.Future, outcome: Any) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _full_attention_only(config) -> bool:
    """Whether every layer attends to the whole prefix, which KV-cache merging assumes."""
    layer_types = getattr(config, "layer_types", None) or []
    return all(t == "full_attention" for t in layer_types) and not getattr(
        config, "use_sliding_window", False
    )
