"""The served model behind the HTTP routes: loading, model-name resolution, generation, weight swaps.

Transport-agnostic on purpose: ``app.py`` and ``openai_api.py`` translate HTTP to these calls.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import torch

from rllm_skyrl.inference.errors import ApiError
from rllm_skyrl.inference.sampling import SamplingParams
from rllm_skyrl.inference.scheduler import GenerationResult, Scheduler
from rllm_skyrl.inference.weights import load_full_weights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class InferenceService:
    """One HF causal LM plus tokenizer, served through a ``Scheduler``."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        max_batch_size: int = 256,
        max_prefill_tokens: int = 8192,
        dtype: str = "float32",
        seed: int = 0,
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
        self.scheduler = Scheduler(
            model,
            self.tokenizer,
            max_model_len=self.max_model_len,
            max_batch_size=max_batch_size,
            max_prefill_tokens=max_prefill_tokens,
            seed=seed,
            can_merge=_full_attention_only(model.config.get_text_config()),
        )
        self.weights_path: str | None = None

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

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

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> GenerationResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def on_done(outcome: GenerationResult | BaseException) -> None:
            loop.call_soon_threadsafe(_settle, future, outcome)

        self.scheduler.submit(prompt_ids, params, on_done, adapter=adapter)
        return await future

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:
            raise ApiError(400, f"the chat template rejected the messages: {exc}") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def output_text(self, result: GenerationResult, params: SamplingParams) -> str:
        """Decoded completion, cut before a matched stop string unless asked to keep it."""
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=params.skip_special_tokens)
        if isinstance(result.stop_reason, str) and not params.include_stop_str_in_output:
            cut = text.find(result.stop_reason)
            if cut >= 0:
                text = text[:cut]
        return text

    # ------------------------------------------------------------------ control plane
    async def on_thread(self, fn) -> Any:
        """Run ``fn`` on the generation thread, between decode steps."""
        return await asyncio.wrap_future(self.scheduler.call(fn))

    async def load_weights(self, path: str, weight_version: int | None) -> dict[str, Any]:
        """Copy a ``save_pretrained`` checkpoint into the served model and record its version."""
        if self.scheduler.lora.names:
            raise ApiError(
                409,
                f"LoRA adapters {self.scheduler.lora.names} are loaded; unload them "
                "(POST /v1/unload_lora_adapter) before loading full weights",
            )

        def load() -> dict[str, Any]:
            start = time.perf_counter()
            load_full_weights(self.scheduler.model, path)
            version = self.scheduler.weight_version + 1 if weight_version is None else int(weight_version)
            self.scheduler.weight_version = version
            self.weights_path = path
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
        def wake() -> None:
            if tags:
                self.scheduler.sleeping_tags.difference_update(tags)
            else:
                self.scheduler.sleeping_tags.clear()

        await self.on_thread(wake)


def _settle(future: asyncio.Future, outcome: GenerationResult | BaseException) -> None:
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
