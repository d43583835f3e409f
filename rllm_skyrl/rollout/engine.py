"""``SkyRLEngine``: rLLM's rollout-engine contract over SkyRL's ``RemoteInferenceClient``.

The engine applies the chat template itself and sends token ids, so the ids and logprobs it
returns are exactly what the policy sampled: no re-tokenisation drift between rollout and training.
It only talks to the client, so it drives this package's CPU server and SkyRL's vLLM servers alike.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import zlib
from dataclasses import dataclass
from typing import Any

from rllm_skyrl import rllm_api
from rllm_skyrl.inference.tool_calls import find_calls
from rllm_skyrl.records import ModelOutput
from rllm_skyrl.rollout import gateway
from rllm_skyrl.rollout.ledger import RolloutLedger
from rllm_skyrl.rollout.request_batching import SampleBatcher
from rllm_skyrl.rollout.sampling import (
    DEFAULT_SAMPLING_PARAMS,
    RequestSeeds,
    continuation_seed,
    request_params,
)

logger = logging.getLogger(__name__)

MAX_PROMPT_LENGTH_EXCEEDED = "max_prompt_length_exceeded"
MAX_RESPONSE_LENGTH_EXCEEDED = "max_response_length_exceeded"
# Distinct conversations whose prompt ids are kept (a batch's tasks, with room to spare).
RENDER_CACHE_SIZE = 4096
_RENDER_KEY = json.JSONEncoder(sort_keys=True)

_THINK_END = "</think>"
# Seconds ``close`` gives the calls it cancels to unwind before it closes their sessions.
CLOSE_GRACE_S = 5.0


@dataclass
class TokenOutput:
    """What the server returned for one token-in request (after abort-retries are stitched)."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length"


def policy_model_name(run: Any) -> str | None:
    """The ``model`` rollouts name: for a LoRA policy the name SkyRL's weight sync loads the adapter
    under, else None (the servers' base model)."""
    if not run.lora.enabled:
        return None
    from skyrl.backends.skyrl_train.inference_servers.utils import resolve_policy_model_name

    return resolve_policy_model_name(run.skyrl)


def termination_reason(output: ModelOutput) -> str | None:
    """The rLLM termination reason a finished call implies (a truncated response), if any."""
    return MAX_RESPONSE_LENGTH_EXCEEDED if output.finish_reason == "length" else None


class SkyRLEngine:
    """rLLM ``RolloutEngine`` semantics on top of ``RemoteInferenceClient``.

    ``client`` handles the control plane (sleep/wake fan-out); data requests go to ``data_clients``,
    chosen by session id so the turns of one multi-turn rollout land on the same server. rLLM's
    workflow engine sets ``is_validation``; the backend bumps ``weight_version`` after every weight
    sync, and outputs are stamped with the version live when their request started.

    ``request_seed`` (None: off) seeds every request (``rollout.sampling.RequestSeeds``): sampling
    then does not depend on server RNG state, so a run resumed from a checkpoint samples exactly what
    the uninterrupted run sampled. A caller's ``seed`` wins.
    """

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        *,
        max_prompt_length: int,
        max_response_length: int,
        train_sampling_params: dict[str, Any] | None = None,
        val_sampling_params: dict[str, Any] | None = None,
        model: str | None = None,
        base_model: str | None = None,
        data_clients: list[Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        disable_thinking: bool = False,
        render_with_parser: bool = False,
    ):
        self.client = client
        self.data_clients = data_clients or [client]
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.train_sampling_params = {**DEFAULT_SAMPLING_PARAMS, **(train_sampling_params or {})}
        self.val_sampling_params = {**self.train_sampling_params, **(val_sampling_params or {})}
        self.model = model
        self.base_model = base_model
        # A template that can switch thinking off (Qwen3's) reads enable_thinking; others ignore it.
        self.chat_template_kwargs = {
            **({"enable_thinking": False} if disable_thinking else {}),
            **(chat_template_kwargs or {}),
        }
        self.disable_thinking = disable_thinking
        self.render_with_parser = render_with_parser
        self.is_validation = False
        self.weight_version = 0
        self.ledger = RolloutLedger()
        self._rendered: dict[str, list[int]] = {}  # see render()
        self.batcher = SampleBatcher(model)
        self._chat_parser: Any = None
        self._round_robin = itertools.cycle(range(len(self.data_clients)))
        self._warned_keys: set[str] = set()
        self.request_seed: int | None = None
        self.seeds = RequestSeeds()
        self.gateway: Any = None  # rLLM's model gateway when an AgentFlow samples through it
        self._callers: set[asyncio.Task] = set()  # tasks waiting on a server, cancelled by close()

    @property
    def server_addresses(self) -> list[str]:
        """Every inference server's URL (with its credentials): rLLM's model gateway forwards an
        AgentFlow's calls to these, as it does to verl's servers."""
        return list(self.client.server_urls)

    @property
    def served_model(self) -> str:
        """The name the servers know the policy by: the LoRA adapter's, else the base model's (its
        directory on our CPU servers, which the gateway's cumulative token mode loads a tokenizer from)."""
        return self.model or self.base_model or self.client.model_name

    def gateway_session_params(self, is_validation: bool, given: dict[str, Any] | None) -> dict[str, Any]:
        """What rLLM's model gateway pins on a session: see ``rollout.gateway.session_params``."""
        return gateway.session_params(self, is_validation, given)

    async def publish_weight_version(self, version: int) -> None:
        """Stamp later rollouts with ``version``, the gateway's traces too when one is attached."""
        self.weight_version = version
        if self.gateway is not None:
            await self.gateway.aset_weight_version(version)

    @classmethod
    def from_urls(
        cls, server_urls: list[str], tokenizer: Any, *, uses_lora_weight_sync: bool = False, **kwargs: Any
    ):
        """An engine over servers addressed directly (no router): one client per server for data,
        plus one that fans control calls out to all of them.

        ``uses_lora_weight_sync``: SkyRL's client then refuses requests that name no model (pass the
        adapter's name as ``model``) instead of sampling the base model.
        """
        from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient

        def make(proxy: str, urls: list[str]) -> RemoteInferenceClient:
            return RemoteInferenceClient(
                proxy_url=proxy,
                server_urls=urls,
                data_parallel_size=1,
                tokenizer=tokenizer,
                uses_lora_weight_sync=uses_lora_weight_sync,
            )

        if not server_urls:
            raise ValueError("server_urls is empty; pass at least one inference server URL")
        control = make(server_urls[0], list(server_urls))
        data = [make(url, [url]) for url in server_urls] if len(server_urls) > 1 else None
        return cls(control, tokenizer, data_clients=data, **kwargs)

    @classmethod
    def for_servers(cls, servers: Any, tokenizer: Any, run: Any) -> SkyRLEngine:
        """The engine a run samples from: SkyRL's own client when SkyRL started the servers, else
        clients over their URLs; lengths and sampling params from the ``RunConfig``."""
        effort = run.rollout.reasoning_effort
        engine_args = dict(
            max_prompt_length=run.max_prompt_length,
            max_response_length=run.max_response_length,
            train_sampling_params=dict(run.train_sampling),
            val_sampling_params=dict(run.val_sampling),
            chat_template_kwargs={"reasoning_effort": effort} if effort else None,
            disable_thinking=run.rollout.disable_thinking,
            render_with_parser=run.rollout.render_with_parser,
            model=policy_model_name(run),
            base_model=getattr(servers, "model_dir", None),
        )
        if getattr(servers, "client", None) is not None:
            return cls(servers.client, tokenizer, **engine_args)
        return cls.from_urls(servers.urls, tokenizer, uses_lora_weight_sync=run.lora.enabled, **engine_args)

    @property
    def supports_token_in_token_out(self) -> bool:
        return True

    @property
    def chat_parser(self) -> Any:
        """rLLM's parser for the chat template (None without rLLM): rLLM's workflows render prompts
        with it (``CumulativeWorkflow`` counts prompt tokens that way), as with rLLM's verl engine."""
        if self._chat_parser is None:
            self._chat_parser = rllm_api.chat_parser(self.tokenizer, disable_thinking=self.disable_thinking)
        return self._chat_parser

    async def get_model_response(self, messages: list[dict[str, Any]], **kwargs: Any) -> ModelOutput:
        """Raises ``TerminationEvent("max_prompt_length_exceeded")`` (rLLM's class if installed) for a
        prompt over ``max_prompt_length``; a response cut at the limit has ``finish_reason="length"``."""
        weight_version = self.weight_version
        tools = kwargs.pop("tools", None)
        accumulate_reasoning = bool(kwargs.pop("accumulate_reasoning", False))
        prompt_ids = self.render(messages, tools=tools, accumulate_reasoning=accumulate_reasoning)
        token_output = await self.get_token_output_from_token_input(prompt_ids, **kwargs)
        output = self.assemble_model_output(prompt_ids, token_output)
        output.weight_version = weight_version
        self.ledger.record(kwargs.get("application_id"), output)
        return output

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        accumulate_reasoning: bool = False,
    ) -> list[int]:
        """Prompt ids: the tokenizer's chat template, or rLLM's parser when asked to render with it
        (``rollout_engine.bypass_render_with_parser``, as rLLM's tinker engine does).

        Every task is rolled out n times at once, so the same messages come n times in a row: the
        ids are kept for the last ``RENDER_CACHE_SIZE`` distinct JSON-serialisable conversations.
        """
        try:
            key = _RENDER_KEY.encode([messages, tools, accumulate_reasoning])
        except (TypeError, ValueError):  # not plain JSON (an image, say): rendered every time
            return self._render(messages, tools, accumulate_reasoning)
        ids = self._rendered.get(key)
        if ids is None:
            if len(self._rendered) >= RENDER_CACHE_SIZE:
                self._rendered.clear()
            ids = self._rendered[key] = self._render(messages, tools, accumulate_reasoning)
        return list(ids)

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, accumulate_reasoning: bool
    ) -> list[int]:
        if self.render_with_parser:
            text = self.chat_parser.parse(
                messages,
                add_generation_prompt=True,
                is_first_msg=True,
                tools=tools or None,
                accumulate_reasoning=accumulate_reasoning,
            )
        else:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=True,
                **self.chat_template_kwargs,
            )
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def get_token_output_from_token_input(self, token_input: list[int], **kwargs: Any) -> TokenOutput:
        """A request the server aborts (a weight sync paused it with ``mode=abort``) is resumed with
        prompt + partial completion for the remaining budget: callers never see ``"abort"``."""
        enforce = kwargs.pop("enforce_max_prompt_length", True)
        flags = (kwargs.pop("validate", False), kwargs.pop("is_validation", False))
        validate = self.is_validation or any(flags)
        application_id = kwargs.pop("application_id", None)
        session_id = kwargs.pop("session_id", None) or application_id
        prompt = list(token_input)
        if enforce and len(prompt) > self.max_prompt_length:
            raise rllm_api.termination_event(MAX_PROMPT_LENGTH_EXCEEDED)
        defaults = self.val_sampling_params if validate else self.train_sampling_params
        params = request_params(defaults, kwargs, self.max_response_length, self._warned_keys)
        if self.request_seed is not None and params.get("seed") is None:
            params["seed"] = self.seeds.next(
                self.request_seed, self.weight_version, prompt, validate, application_id
            )
        budget = params.pop("max_tokens")
        caller = asyncio.current_task()
        self._callers.add(caller)
        try:
            return await self._sample(self._data_client(session_id), session_id, prompt, params, budget)
        finally:
            self._callers.discard(caller)

    async def _sample(
        self, client: Any, session_id: Any, prompt: list[int], params: dict[str, Any], budget: int
    ) -> TokenOutput:
        tokens: list[int] = []
        logprobs: list[float] | None = [] if params.get("logprobs") is not None else None
        while True:
            step_params = {**params, "max_tokens": budget - len(tokens)}
            if tokens and params.get("seed") is not None:  # continuing after an abort: fresh numbers
                step_params["seed"] = continuation_seed(params["seed"], len(tokens))
            if params.get("min_tokens"):
                still_needed = params["min_tokens"] - len(tokens)
                step_params["min_tokens"] = max(0, min(still_needed, step_params["max_tokens"]))
            batched = None if tokens else await self.batcher.sample(client, prompt, step_params)
            if batched is not None:  # sampled together with the same prompt's other rollouts
                new_tokens, new_logprobs, reason = batched
            else:
                out = await client.generate(
                    {
                        "prompt_token_ids": [prompt + tokens],
                        "sampling_params": step_params,
                        "session_ids": [session_id] if session_id is not None else None,
                    },
                    model=self.model,
                )
                new_tokens, reason = out["response_ids"][0], out["stop_reasons"][0]
                new_logprobs = out["response_logprobs"][0] if out["response_logprobs"] else None
            tokens.extend(new_tokens)
            if logprobs is not None:
                logprobs.extend(new_logprobs or [])
            if reason != "abort" or len(tokens) >= budget:
                break
        if reason == "abort":  # the loop only stops on an abort once the budget is spent
            reason = "length"
        return TokenOutput(tokens[:budget], logprobs[:budget] if logprobs is not None else None, reason)

    def assemble_model_output(self, token_input: list[int], token_output: TokenOutput) -> ModelOutput:
        text = self.tokenizer.decode(token_output.token_ids, skip_special_tokens=True)
        reasoning, content = _split_reasoning(text)
        return rllm_api.model_output_class()(
            text=text,
            content=content,
            reasoning=reasoning,
            tool_calls=_parse_tool_calls(content),
            prompt_ids=list(token_input),
            completion_ids=list(token_output.token_ids),
            logprobs=token_output.logprobs,
            prompt_length=len(token_input),
            completion_length=len(token_output.token_ids),
            finish_reason=token_output.finish_reason,
        )

    def _data_client(self, session_id: Any) -> Any:
        if session_id is not None:
            return self.data_clients[zlib.crc32(str(session_id).encode()) % len(self.data_clients)]
        return self.data_clients[next(self._round_robin)]

    async def wake_up(self) -> None:
        await self.client.wake_up()

    async def close(self) -> None:
        """Call inside the event loop that opened the clients' HTTP sessions.

        Rollouts still waiting on a server are cancelled first. rLLM leaves them running when a run
        stops (Ctrl-C, SIGTERM, an error): a session closed under them would fail them with
        "Connection closed", which rLLM's workflow engine logs with a traceback and retries.
        """
        callers = self._callers - {asyncio.current_task()}
        for caller in callers:
            caller.cancel()
        if callers:
            await asyncio.wait(callers, timeout=CLOSE_GRACE_S)
        for client in {id(c): c for c in [self.client, *self.data_clients]}.values():
            await client.teardown()

    async def sleep(self) -> None:
        await self.client.sleep(level=1)


def _split_reasoning(text: str) -> tuple[str, str]:
    """``("<reasoning>", "<answer>")`` for ``<think>...</think>`` outputs, else ``("", text)``."""
    if _THINK_END not in text:
        return "", text
    reasoning, _, content = text.partition(_THINK_END)
    return reasoning.replace("<think>", "", 1).strip(), content.strip()


def _parse_tool_calls(content: str) -> list[Any]:
    return [rllm_api.tool_call(call.name, call.arguments) for call in find_calls(content)]
