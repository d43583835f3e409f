"""SkyRLEngine over SkyRL's RemoteInferenceClient, against the CPU inference server."""

from __future__ import annotations

import asyncio
import itertools
import threading

import aiohttp
import pytest
import torch
from helpers import async_wait_until

from rllm_skyrl import rllm_api as rllm
from rllm_skyrl.inference import InferenceServer
from rllm_skyrl.rollout.engine import (
    MAX_PROMPT_LENGTH_EXCEEDED,
    MAX_RESPONSE_LENGTH_EXCEEDED,
    ModelOutput,
    SkyRLEngine,
    TokenOutput,
    termination_reason,
)

MESSAGES = [{"role": "user", "content": "what is 3 plus 4?"}]
WAIT = 60.0  # seconds any one wait on a server may take before the test fails


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The in-process servers run the tiny model, where per-op overhead dominates: extra threads
    only contend with the test's own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def server(cpu_server):
    return cpu_server


def make_engine(server, tokenizer, urls=None, **kwargs) -> SkyRLEngine:
    options = dict(max_prompt_length=64, max_response_length=16) | kwargs
    return SkyRLEngine.from_urls(urls or [server.url], tokenizer, **options)


def run(engine: SkyRLEngine, coro_fn):
    """Run ``await coro_fn(engine)`` on a fresh loop, closing the engine's HTTP sessions after."""

    async def main():
        try:
            return await coro_fn(engine)
        finally:
            for client in {id(c): c for c in [engine.client, *engine.data_clients]}.values():
                await client.teardown()

    return asyncio.run(main())


def test_model_output_fields(server, tiny_tokenizer):
    engine = make_engine(server, tiny_tokenizer)
    engine.weight_version = 3
    out = run(engine, lambda e: e.get_model_response(MESSAGES, application_id="task-1:0"))
    assert isinstance(out, rllm.model_output_class())  # rLLM's own class when rLLM is installed
    expected_prompt = tiny_tokenizer.encode(
        tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    assert out.prompt_ids == expected_prompt and out.prompt_length == len(expected_prompt)
    assert 1 <= out.completion_length == len(out.completion_ids) == len(out.logprobs) <= 16
    assert out.text == tiny_tokenizer.decode(out.completion_ids, skip_special_tokens=True)
    assert out.content == out.text and out.reasoning == "" and out.tool_calls == []
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.completion_ids[-1] == tiny_tokenizer.eos_token_id
    assert out.weight_version == 3
    assert out.to_dict()["completion_ids"] == out.completion_ids


def test_prompt_over_max_prompt_length_terminates(server, tiny_tokenizer):
    engine = make_engine(server, tiny_tokenizer, max_prompt_length=8)
    with pytest.raises(Exception) as info:
        run(engine, lambda e: e.get_model_response(MESSAGES))
    assert getattr(info.value.reason, "value", info.value.reason) == MAX_PROMPT_LENGTH_EXCEEDED
    # Callers may opt out of the check (rLLM's enforce_max_prompt_length=False).
    out = run(engine, lambda e: e.get_model_response(MESSAGES, enforce_max_prompt_length=False, max_tokens=2))
    assert out.completion_length <= 2


def test_truncated_response_maps_to_max_response_length_exceeded(server, tiny_tokenizer):
    engine = make_engine(server, tiny_tokenizer, train_sampling_params={"ignore_eos": True})
    # A per-call budget above max_response_length is clipped to it.
    out = run(engine, lambda e: e.get_model_response(MESSAGES, max_tokens=100))
    assert out.completion_length == 16 and out.finish_reason == "length"
    assert termination_reason(out) == MAX_RESPONSE_LENGTH_EXCEEDED
    assert termination_reason(ModelOutput(finish_reason="stop")) is None


def test_train_and_validation_sampling_params(server, tiny_tokenizer):
    engine = make_engine(
        server,
        tiny_tokenizer,
        train_sampling_params={"temperature": 1.0, "ignore_eos": True},
        val_sampling_params={"temperature": 0.0},
    )

    async def sample(e: SkyRLEngine):
        e.is_validation = True
        val = [await e.get_model_response(MESSAGES) for _ in range(2)]
        e.is_validation = False
        train = [await e.get_model_response(MESSAGES, seed=s) for s in range(3)]
        return val, train

    val, train = run(engine, sample)
    assert val[0].completion_ids == val[1].completion_ids
    assert len({tuple(o.completion_ids) for o in train}) > 1


def test_token_in_token_out(server, tiny_tokenizer):
    engine = make_engine(server, tiny_tokenizer)
    assert engine.supports_token_in_token_out
    prompt = engine.render(MESSAGES)
    token_output = run(
        engine, lambda e: e.get_token_output_from_token_input(prompt, max_tokens=5, min_tokens=5)
    )
    assert isinstance(token_output, TokenOutput)
    assert len(token_output.token_ids) == len(token_output.logprobs) == 5
    assert token_output.finish_reason == "length"
    out = engine.assemble_model_output(prompt, token_output)
    assert out.prompt_ids == prompt and out.completion_ids == token_output.token_ids


async def server_stats(url: str) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/rllm_skyrl/v1/stats") as response:
            return await response.json()


def hold_generation_until_a_control_call(monkeypatch, server, after_steps: int) -> threading.Event:
    """Make the server's generation thread stop after ``after_steps`` decode steps and wait there
    until a control call (pause, ...) is queued, so that call lands mid-request whatever the
    machine's speed. The returned event is set once the thread holds."""
    scheduler = server.service.scheduler
    running = scheduler._running
    decode = running.decode_step
    holding = threading.Event()
    steps = itertools.count(1)

    def gated_decode_step() -> None:
        decode()
        if next(steps) == after_steps:
            holding.set()
            with scheduler._cv:
                queued = scheduler._cv.wait_for(lambda: scheduler._calls or scheduler._stopping, timeout=WAIT)
            assert queued, "no control call reached the server"

    monkeypatch.setattr(running, "decode_step", gated_decode_step)
    return holding


def test_abort_during_weight_sync_is_resumed(server, tiny_tokenizer, monkeypatch):
    engine = make_engine(server, tiny_tokenizer, max_response_length=450)

    client = engine.data_clients[0]
    calls = []

    async def counting_generate(input_batch, model=None):
        calls.append(len(input_batch["prompt_token_ids"][0]))
        return await type(client).generate(client, input_batch, model=model)

    client.generate = counting_generate
    holding = hold_generation_until_a_control_call(monkeypatch, server, after_steps=3)

    async def scenario(e: SkyRLEngine):
        task = asyncio.create_task(e.get_model_response(MESSAGES, min_tokens=450))
        assert await asyncio.to_thread(holding.wait, WAIT), "the request never started decoding"
        await e.client.pause(mode="abort")  # the held request is aborted with its partial completion
        # The engine resubmits at once; the paused server queues it until the resume.
        await async_wait_until(lambda: resubmitted(server.url), WAIT, "the resubmitted request to queue")
        await e.client.resume()
        return await task

    out = run(engine, scenario)
    assert out.completion_length == len(out.logprobs) == 450 and out.finish_reason == "length"
    # The aborted call was resubmitted with its partial completion appended to the prompt.
    assert len(calls) == 2 and calls[0] == out.prompt_length
    assert calls[1] - calls[0] >= 3, "the partial completion must be carried over"


async def resubmitted(url: str) -> bool:
    stats = await server_stats(url)
    return stats["paused"] and stats["waiting"] >= 1


def record_generate_calls(monkeypatch, servers) -> list[tuple[int, str]]:
    """(server index, prompt text) for every generation job each server receives (every route
    queues its jobs through ``generate_many``)."""
    received: list[tuple[int, str]] = []
    for index, srv in enumerate(servers):
        original = srv.service.generate_many

        async def recording(jobs, *args, _index=index, _original=original, _srv=srv, **kwargs):
            received.extend((_index, _srv.service.tokenizer.decode(prompt_ids)) for prompt_ids, _ in jobs)
            return await _original(jobs, *args, **kwargs)

        monkeypatch.setattr(srv.service, "generate_many", recording)
    return received


def test_sleep_wake_and_routing_over_two_servers(server, tiny_model_dir, tiny_tokenizer, monkeypatch):
    """Control calls reach both servers; a session's requests stay on one server, and requests
    without a session are spread over both."""
    with InferenceServer(tiny_model_dir) as second:
        servers = [server, second]
        received = record_generate_calls(monkeypatch, servers)
        engine = make_engine(server, tiny_tokenizer, urls=[s.url for s in servers], max_response_length=2)
        assert len(engine.data_clients) == 2
        sessions = [f"task-{i}:0" for i in range(8)]

        async def conversation(e: SkyRLEngine, session: str):
            for turn in range(3):
                message = [{"role": "user", "content": f"{session} turn {turn}"}]
                await e.get_model_response(message, application_id=session)

        async def scenario(e: SkyRLEngine):
            await e.sleep()
            asleep = [(await server_stats(s.url))["sleeping"] for s in servers]
            await e.wake_up()
            awake = [(await server_stats(s.url))["sleeping"] for s in servers]
            await asyncio.gather(*(conversation(e, session) for session in sessions))
            messages = [[{"role": "user", "content": f"no session {i}"}] for i in range(4)]
            await asyncio.gather(*(e.get_model_response(m) for m in messages))
            return asleep, awake

        asleep, awake = run(engine, scenario)

    assert all(asleep) and not any(awake), (asleep, awake)
    by_session = {
        session: {index for index, text in received if f"{session} turn" in text} for session in sessions
    }
    assert all(len(where) == 1 for where in by_session.values()), by_session
    assert all(sum(f"{session} turn" in text for _, text in received) == 3 for session in sessions)
    assert {where for (where,) in by_session.values()} == {0, 1}, "sessions must use both servers"
    unbound = [index for index, text in received if "no session" in text]
    assert sorted(unbound) == [0, 0, 1, 1], "requests without a session must alternate"


def test_reasoning_and_tool_calls_are_parsed(tiny_tokenizer):
    engine = SkyRLEngine(None, tiny_tokenizer, max_prompt_length=8, max_response_length=8)
    text = '<think>add them</think>the answer <tool_call>{"name": "calc", "arguments": {"a": 3}}</tool_call>'
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    out = engine.assemble_model_output([1, 2], TokenOutput(ids, None, "stop"))
    assert out.reasoning == "add them"
    assert out.content.startswith("the answer")
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("calc", {"a": 3})]


def test_render_reuses_the_ids_of_a_conversation_without_sharing_them(tiny_tokenizer):
    """The n rollouts of a task render once; each caller gets its own list, and a different
    conversation (or one that is not plain JSON) is rendered afresh."""
    engine = SkyRLEngine.from_urls(
        ["http://127.0.0.1:9"], tiny_tokenizer, max_prompt_length=64, max_response_length=8
    )
    expected = tiny_tokenizer.encode(
        tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    first = engine.render(MESSAGES)
    first.append(-1)  # a caller's edit stays its own
    assert engine.render(MESSAGES) == expected and len(engine._rendered) == 1
    other = [{"role": "user", "content": "what is 5 plus 1?"}]
    assert engine.render(other) != expected and len(engine._rendered) == 2

    unusual = [{**MESSAGES[0], "meta": object()}]  # not JSON: rendered every time, never kept
    assert engine.render(unusual) == expected and len(engine._rendered) == 2


class _ClosingClient:
    """Answers nothing until torn down, then fails what waits as aiohttp does on a closed session."""

    def __init__(self) -> None:
        self.waiting = 0
        self.closed = asyncio.Event()

    async def _wait(self, *args, **kwargs):
        self.waiting += 1
        await self.closed.wait()
        raise RuntimeError("Connection closed.")

    sample = generate = _wait

    async def teardown(self) -> None:
        self.closed.set()


@pytest.mark.parametrize("params", [{}, {"min_tokens": 2}], ids=["batched", "alone"])
def test_close_cancels_the_calls_still_waiting_on_a_server(tiny_tokenizer, params):
    """A run stopped mid-rollout closes the engine while rLLM's rollouts still wait: they end
    cancelled, not failed with "Connection closed" (which rLLM logs with a traceback and retries)."""
    client = _ClosingClient()
    engine = SkyRLEngine(client, tiny_tokenizer, max_prompt_length=64, max_response_length=8)

    async def main():
        rollouts = [asyncio.create_task(engine.get_model_response(MESSAGES, **params)) for _ in range(3)]

        async def waiting():  # the three share one call when batched
            return client.waiting >= (3 if params else 1)

        await async_wait_until(waiting, WAIT, "the calls to reach the server")
        await engine.close()
        return await asyncio.gather(*rollouts, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert client.closed.is_set()
    assert all(isinstance(outcome, asyncio.CancelledError) for outcome in outcomes), outcomes
