"""Identical concurrent prompts become one ``sample`` request for n completions."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rllm_skyrl.inference import InferenceServer
from rllm_skyrl.inference.openai_api import MAX_CHOICES
from rllm_skyrl.rollout.engine import SkyRLEngine
from rllm_skyrl.rollout.request_batching import MAX_SAMPLES, SampleBatcher, sample_params

PROMPT = [1, 2, 3]


class RecordingClient:
    """Answers ``sample`` like a server: ``num_samples`` sequences, each tagged with its call."""

    def __init__(self, fail: BaseException | None = None, short: bool = False) -> None:
        self.calls: list[dict] = []
        self.fail = fail
        self.short = short

    async def sample(self, request: dict) -> dict:
        body = request["json"]
        self.calls.append(body)
        call = len(self.calls)
        await asyncio.sleep(0)
        if self.fail is not None:
            raise self.fail
        count = body["num_samples"] - (1 if self.short else 0)
        sequence = {"logprobs": [-0.5, -0.5], "stop_reason": "stop"}
        return {"sequences": [{"tokens": [call, i], **sequence} for i in range(count)]}


def gather(batcher: SampleBatcher, client, requests: list[tuple[list[int], dict]]) -> list:
    async def main():
        return await asyncio.gather(
            *(batcher.sample(client, prompt, params) for prompt, params in requests), return_exceptions=True
        )

    return asyncio.run(main())


def test_the_server_serves_a_full_group():
    assert MAX_SAMPLES <= MAX_CHOICES


def test_concurrent_identical_prompts_share_one_call():
    client = RecordingClient()
    params = {"temperature": 1.0, "max_tokens": 4, "logprobs": 0}
    out = gather(SampleBatcher(model="m"), client, [(PROMPT, params)] * 5 + [([9], params)] * 2)
    assert [c["num_samples"] for c in client.calls] == [5, 2]
    assert client.calls[0]["sampling_params"] == {"temperature": 1.0, "max_tokens": 4}
    assert client.calls[0]["model"] == "m" and client.calls[0]["prompt"]["chunks"][0]["tokens"] == PROMPT
    assert [tokens for tokens, _, _ in out] == [[1, i] for i in range(5)] + [[2, 0], [2, 1]]


def test_a_group_is_split_at_the_servers_limit():
    client = RecordingClient()
    out = gather(SampleBatcher(max_samples=4), client, [(PROMPT, {"temperature": 1.0})] * 10)
    assert [c["num_samples"] for c in client.calls] == [4, 4, 2]
    assert len({tuple(tokens) for tokens, _, _ in out}) == 10  # every caller got its own completion


@pytest.mark.parametrize(
    "params",
    [{"min_tokens": 2}, {"logprobs": 5}, {"n": 2}, {"repetition_penalty": 1.1}],
)
def test_what_sample_cannot_carry_goes_alone(params):
    assert sample_params(params) is None
    assert gather(SampleBatcher(), RecordingClient(), [(PROMPT, params)]) == [None]


def test_consecutive_seeds_share_a_call_that_starts_at_the_first():
    """Completion i of a call seeded s is sampled with s + i: the callers' own seeds, in order."""
    client = RecordingClient()
    seeds = [7, 8, 9, 20, 21, 9, 9]  # a jump starts a new call, and so does a repeated seed
    out = gather(SampleBatcher(), client, [(PROMPT, {"temperature": 1.0, "seed": s}) for s in seeds])
    calls = [(c["sampling_params"]["seed"], c["num_samples"]) for c in client.calls]
    assert sorted(calls) == [(7, 3), (9, 1), (9, 1), (20, 2)]
    first_seed = {call + 1: seed for call, (seed, _) in enumerate(calls)}
    # caller -> (its call's first seed + its index in the call) is the caller's own seed
    assert [first_seed[call] + i for call, i in (tokens for tokens, _, _ in out)] == seeds


def test_seeded_and_unseeded_callers_do_not_mix():
    client = RecordingClient()
    requests = [(PROMPT, {"seed": 1}), (PROMPT, {}), (PROMPT, {"seed": 2}), (PROMPT, {"seed": -1})]
    gather(SampleBatcher(), client, requests)  # -1 is vLLM's "unseeded", and the server's
    calls = {c["sampling_params"].get("seed", "unseeded"): c["num_samples"] for c in client.calls}
    assert calls == {1: 2, "unseeded": 2} and len(client.calls) == 2


def test_different_parameters_are_different_groups():
    client = RecordingClient()
    gather(SampleBatcher(), client, [(PROMPT, {"temperature": 1.0}), (PROMPT, {"temperature": 0.5})])
    assert [c["num_samples"] for c in client.calls] == [1, 1]


def test_every_caller_sees_the_calls_failure():
    error = ConnectionError("server gone")
    out = gather(SampleBatcher(), RecordingClient(fail=error), [(PROMPT, {})] * 3)
    assert out == [error] * 3


def test_a_short_answer_fails_every_caller_rather_than_guessing():
    out = gather(SampleBatcher(), RecordingClient(short=True), [(PROMPT, {})] * 3)
    assert all(isinstance(o, RuntimeError) and "asked the server for 3 samples, got 2" in str(o) for o in out)


MESSAGES = [{"role": "user", "content": "what is 3?"}]


def rollouts(
    server_url: str, tokenizer, count: int, request_seed: int | None = None, max_samples=MAX_SAMPLES
):
    """``count`` concurrent rollouts of one prompt through the engine; the engine is returned for its
    batcher's count of calls."""
    engine = SkyRLEngine.from_urls(
        [server_url],
        tokenizer,
        max_prompt_length=64,
        max_response_length=8,
        train_sampling_params={"temperature": 1.0},
    )
    engine.request_seed = request_seed
    engine.batcher.max_samples = max_samples

    async def main():
        try:
            return await asyncio.gather(*(engine.get_model_response(MESSAGES) for _ in range(count)))
        finally:
            await engine.close()

    return asyncio.run(main()), engine


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with InferenceServer(tiny_model_dir) as server:
            yield server.url
    finally:
        torch.set_num_threads(threads)


def test_the_engine_batches_against_the_real_server(server_url, tiny_tokenizer):
    """200 rollouts of one prompt: two requests to the server (128 + 72), 200 distinct samples."""
    outputs, engine = rollouts(server_url, tiny_tokenizer, 200)
    assert engine.batcher.requests_sent == 2
    assert all(0 < len(o.completion_ids) == len(o.logprobs) <= 8 for o in outputs)
    assert len({tuple(o.completion_ids) for o in outputs}) > 100


def test_seeded_rollouts_batched_sample_what_each_would_alone(server_url, tiny_tokenizer):
    """With every request seeded (``inference.deterministic_sampling``), a prompt's 40 rollouts are
    one call to the server, and each gets the completion it gets when sent on its own."""
    batched, batched_engine = rollouts(server_url, tiny_tokenizer, 40, request_seed=5)
    alone, alone_engine = rollouts(server_url, tiny_tokenizer, 40, request_seed=5, max_samples=1)
    assert (batched_engine.batcher.requests_sent, alone_engine.batcher.requests_sent) == (1, 40)
    completions = [tuple(o.completion_ids) for o in batched]
    assert completions == [tuple(o.completion_ids) for o in alone]
    assert len(set(completions)) > 20  # and the seeds differ from rollout to rollout
