"""The CPU inference server, driven through SkyRL's own RemoteInferenceClient."""

from __future__ import annotations

import asyncio
import http.client
import shutil
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
import torch
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient

from rllm_skyrl.inference import InferenceServer
from rllm_skyrl.inference.sampling import SamplingParams
from rllm_skyrl.inference.scheduler import BURST_GAP_S, BURST_MAX_WAIT_S

# Server and HF compute the same fp32 math (log_softmax(logits / T)); only the batch layout
# (left padding, merged KV caches) differs, which moves a logprob by ~1e-6.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory, tiny_model_dir):
    """The server's weights root, holding a copy of the served model to restore it from."""
    root = tmp_path_factory.mktemp("weights_root")
    shutil.copytree(tiny_model_dir, root / "base")
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir, weights_root):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: per-op overhead dominates, extra threads only contend
    with InferenceServer(tiny_model_dir, weights_root=weights_root) as srv:
        yield srv
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    """Chat prompts of different lengths, so batches are left-padded and merged."""
    questions = ["what is 3 plus 4?", "hello", "solve: what is 9 plus 9? think step by step", "yes"]
    return [
        tiny_tokenizer.encode(
            tiny_tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q in questions
    ]


def with_client(server: InferenceServer, tokenizer, fn):
    """Run ``await fn(client)`` on a fresh loop with a SkyRL client pointed at ``server``."""

    async def main():
        async with RemoteInferenceClient(
            proxy_url=server.url, server_urls=[server.url], data_parallel_size=1, tokenizer=tokenizer
        ) as client:
            return await fn(client)

    return asyncio.run(main())


def generate(client, prompts, **sampling):
    return client.generate({"prompt_token_ids": prompts, "sampling_params": sampling})


def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``completion`` under a plain, unpadded HF forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


async def post(url: str, payload: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, json=payload) as resp:
            return resp.status, await resp.json()


async def stats(server: InferenceServer) -> dict:
    status, body = await post(f"{server.url}/rllm_skyrl/v1/stats", method="GET")
    assert status == 200, body
    return body


async def wait_for(server: InferenceServer, predicate, what: str, timeout: float = 60.0) -> dict:
    """Poll the server's own state until ``predicate(stats)``; fail naming ``what`` after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        current = await stats(server)
        if predicate(current):
            return current
        if loop.time() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}; server state: {current}")
        await asyncio.sleep(0.002)


async def until_running(server: InferenceServer) -> dict:
    """Wait until the server is decoding something (so a pause lands mid-request)."""
    return await wait_for(server, lambda s: s["running"] >= 1, "a request to start decoding")


async def generation_thread_turns(client, turns: int = 20, asleep: bool = False) -> None:
    """Make the generation thread go round its loop ``turns`` times: each control call runs on it
    between two decode steps. A scheduler that is (wrongly) still decoding advances meanwhile, so
    a "nothing moved" check after this does not depend on how long anything took."""
    for _ in range(turns):
        # No-ops in the server's current state, but each is a turn of the loop.
        await (client.sleep(level=1) if asleep else client.wake_up())


def max_abs_diff(expected: torch.Tensor, served: list[float]) -> float:
    return float((expected - torch.tensor(served)).abs().max())


def test_generate_shapes_and_finish_reasons(server, tiny_tokenizer, prompts):
    out = with_client(server, tiny_tokenizer, lambda c: generate(c, prompts, max_tokens=8, logprobs=0))
    assert len(out["response_ids"]) == len(prompts)
    for ids, lps, reason, text in zip(
        out["response_ids"], out["response_logprobs"], out["stop_reasons"], out["responses"], strict=True
    ):
        assert 1 <= len(ids) <= 8 and len(lps) == len(ids)
        assert reason == "length" if len(ids) == 8 else reason == "stop"
        assert all(lp <= 0 for lp in lps)
        assert text == tiny_tokenizer.decode(ids)

    forced = with_client(
        server, tiny_tokenizer, lambda c: generate(c, prompts, max_tokens=12, min_tokens=12, logprobs=None)
    )
    assert [len(ids) for ids in forced["response_ids"]] == [12] * len(prompts)
    assert forced["stop_reasons"] == ["length"] * len(prompts)
    assert forced["response_logprobs"] is None


def test_skyrl_generator_sampling_params_are_accepted(server, tiny_tokenizer, prompts):
    """The exact dict SkyRL's generator sends (its defaults plus vLLM extras) works as is."""
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
    from skyrl.train.config import SamplingParams as SkyRLSamplingParams

    params = get_sampling_params_for_backend(
        "vllm", SkyRLSamplingParams(max_generate_length=6, stop=["\n\n"])
    )
    out = with_client(server, tiny_tokenizer, lambda c: generate(c, prompts, **params))
    assert all(1 <= len(ids) <= 6 for ids in out["response_ids"])
    assert all(
        len(lps) == len(ids) for lps, ids in zip(out["response_logprobs"], out["response_ids"], strict=True)
    )


def test_temperature_zero_is_deterministic_and_batch_invariant(server, tiny_tokenizer, prompts, hf_model):
    async def run(client):
        batched = await generate(client, prompts, max_tokens=10, min_tokens=10, temperature=0.0)
        alone = await generate(client, prompts[:1], max_tokens=10, min_tokens=10, temperature=0.0)
        return batched, alone

    batched, alone = with_client(server, tiny_tokenizer, run)
    assert batched["response_ids"][0] == alone["response_ids"][0]
    # A plain greedy loop on the HF model picks the same tokens (eos banned, as min_tokens=10 does).
    ids = list(prompts[0])
    with torch.no_grad():
        for _ in range(10):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            logits[tiny_tokenizer.eos_token_id] = float("-inf")
            ids.append(int(logits.argmax()))
    assert alone["response_ids"][0] == ids[len(prompts[0]) :]


def test_seeded_sampling_reproduces_in_any_batch(server, tiny_tokenizer, prompts):
    async def run(client):
        first = await generate(client, prompts[:1], max_tokens=12, min_tokens=12, seed=123)
        crowd = await generate(client, prompts[:1] * 6, max_tokens=12, min_tokens=12, seed=123)
        other = await generate(client, prompts[:1], max_tokens=12, min_tokens=12, seed=124)
        return first, crowd, other

    first, crowd, other = with_client(server, tiny_tokenizer, run)
    assert all(ids == first["response_ids"][0] for ids in crowd["response_ids"])
    assert other["response_ids"][0] != first["response_ids"][0]


def test_stop_token_ids_and_stop_strings(server, tiny_tokenizer, prompts):
    greedy = dict(max_tokens=12, min_tokens=0, temperature=0.0, ignore_eos=True)

    async def run(client):
        base = await generate(client, prompts[:1], **greedy)
        ids = base["response_ids"][0]
        stop_at = next(i for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
        cut = await generate(client, prompts[:1], **greedy, stop_token_ids=[ids[stop_at]])
        chat = await client.chat_completion(
            {"json": {"messages": [{"role": "user", "content": "what is 3 plus 4?"}], **greedy}}
        )
        text = chat["choices"][0]["message"]["content"]
        stop_str = text[3:5]
        stopped = await client.chat_completion(
            {
                "json": {
                    "messages": [{"role": "user", "content": "what is 3 plus 4?"}],
                    **greedy,
                    "stop": [stop_str],
                }
            }
        )
        return ids, stop_at, cut, text, stop_str, stopped

    ids, stop_at, cut, text, stop_str, stopped = with_client(server, tiny_tokenizer, run)
    assert cut["response_ids"][0] == ids[: stop_at + 1]
    assert cut["stop_reasons"] == ["stop"]
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_str
    assert choice["message"]["content"] == text[: text.find(stop_str)]


def test_logprobs_match_hf_forward(server, tiny_tokenizer, prompts, hf_model):
    temperature = 0.7
    sampling = dict(max_tokens=16, temperature=temperature, top_k=20, logprobs=0)

    async def joining(client):
        # The later requests arrive while the first is decoding, so their KV caches are merged
        # into its batch (left-padded to a common width).
        before = (await stats(server))["counters"]
        # The first decodes long enough (128 tokens) that the later ones find it running even on
        # a loaded machine.
        first = asyncio.create_task(
            generate(client, prompts[:1], **{**sampling, "max_tokens": 128}, min_tokens=128)
        )
        await until_running(server)
        later = await asyncio.gather(*(generate(client, [p], **sampling) for p in prompts[1:] * 3))
        after = (await stats(server))["counters"]
        return [await first, *later], after.get("merges", 0) - before.get("merges", 0)

    outs, merges = with_client(server, tiny_tokenizer, joining)
    assert merges >= 1, "the later requests never joined a running batch"
    for prompt, out in zip(prompts[:1] + prompts[1:] * 3, outs, strict=True):
        ids, lps = out["response_ids"][0], out["response_logprobs"][0]
        assert max_abs_diff(hf_logprobs(hf_model, prompt, ids, temperature), lps) <= LOGPROB_TOLERANCE


def test_samples_of_one_prompt_share_its_prefill(server, tiny_tokenizer, prompts, hf_model):
    """Six samples each of two prompts, queued together: one prefill runs the two prompts once, and
    every sample decodes on its copy of its prompt's KV cache as if it had been prefilled alone."""
    temperature = 0.7
    sampling = dict(max_tokens=8, min_tokens=8, temperature=temperature, logprobs=0)
    batch = [prompts[0]] * 6 + [prompts[2]] * 6

    async def run(client):
        before = (await stats(server))["counters"]
        await client.pause(mode="keep")  # the client sends one request per row: let them all queue
        out = asyncio.create_task(generate(client, batch, **sampling))
        await wait_for(server, lambda s: s["waiting"] == len(batch), "every row to queue behind the pause")
        await client.resume()
        out = await out
        after = (await stats(server))["counters"]
        return out, {key: after[key] - before[key] for key in ("prefills", "prefill_tokens")}

    out, ran = with_client(server, tiny_tokenizer, run)
    width = max(len(prompts[0]), len(prompts[2]))
    assert ran == {"prefills": 1, "prefill_tokens": 2 * width}, ran
    assert len({tuple(ids) for ids in out["response_ids"]}) > 2, "the samples of a prompt are all alike"
    for prompt, ids, lps in zip(batch, out["response_ids"], out["response_logprobs"], strict=True):
        assert max_abs_diff(hf_logprobs(hf_model, prompt, ids, temperature), lps) <= LOGPROB_TOLERANCE


def test_an_idle_server_admits_a_burst_as_one_prefill_but_does_not_wait_out_a_stream(server, prompts):
    """Requests arriving less than ``BURST_GAP_S`` apart share one prefill, as if queued together;
    a steady stream is still admitted while it lasts (after at most the burst's maximum wait).

    A busy machine may pause the submitting thread past the gap, which rightly splits the burst:
    only bursts whose arrivals provably stayed inside the window are held to one prefill. A
    request arrives somewhere inside its ``submit`` call, so two arrivals are at most the end of
    the later call minus the start of the earlier one apart."""
    scheduler = server.service.scheduler
    params = SamplingParams.from_dict({"max_tokens": 1})
    done: list[float] = []

    def submit(prompt):
        scheduler.submit([(prompt, params, lambda outcome: done.append(time.monotonic()))])

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 60
        while len(done) < count and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(done) == count

    in_window = 0
    for _ in range(50):
        done.clear()
        before = scheduler.counters["prefills"]
        started = time.monotonic()
        previous_start, widest_gap = started, 0.0
        for prompt in prompts:
            call_start = time.monotonic()
            submit(prompt)
            ended = time.monotonic()
            widest_gap, previous_start = max(widest_gap, ended - previous_start), call_start
            time.sleep(BURST_GAP_S / 4)
        wait_for(len(prompts))
        if widest_gap < BURST_GAP_S and ended - started < BURST_MAX_WAIT_S:
            assert scheduler.counters["prefills"] - before == 1
            in_window += 1
            if in_window == 3:
                break
    assert in_window > 0, "no burst arrived inside the window in 50 tries"

    done.clear()
    submitted = 0
    deadline = time.monotonic() + 60
    while not done and time.monotonic() < deadline:  # the stream lasts until the first is answered
        submit(prompts[1])
        submitted += 1
        time.sleep(BURST_GAP_S / 4)
    assert done, "the first request waited for the stream"
    wait_for(submitted)  # leave the server idle


def test_a_delivered_request_no_longer_counts_as_running(server, prompts):
    """A caller may read the stats the moment its result arrives, before the step that finished it
    ends: by then the request must not be counted as running (or as blocking an adapter unload)."""
    scheduler = server.service.scheduler
    seen: list[int] = []

    def on_done(outcome):
        seen.append(scheduler.num_running)

    # A row that finishes while another keeps decoding, and the last row of a batch.
    scheduler.submit(
        [
            (prompts[0], SamplingParams.from_dict({"max_tokens": 2, "min_tokens": 2}), on_done),
            (prompts[1], SamplingParams.from_dict({"max_tokens": 6, "min_tokens": 6}), on_done),
        ]
    )
    deadline = time.monotonic() + 30
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [1, 0], f"running counts seen by the two callbacks: {seen}"


def test_256_concurrent_requests_all_complete(server, tiny_tokenizer, prompts):
    many = [prompts[i % len(prompts)] + [5] * (i % 7) for i in range(256)]

    async def run(client):
        budgets = [1 + i % 16 for i in range(256)]
        results = await asyncio.gather(
            *(
                generate(client, [p], max_tokens=b, min_tokens=b, logprobs=0)
                for p, b in zip(many, budgets, strict=True)
            )
        )
        return budgets, results

    before = asyncio.run(stats(server))["counters"]
    budgets, results = with_client(server, tiny_tokenizer, run)
    assert [len(r["response_ids"][0]) for r in results] == budgets
    assert all(len(r["response_logprobs"][0]) == b for r, b in zip(results, budgets, strict=True))
    after = asyncio.run(stats(server))
    assert after["running"] == 0 and after["waiting"] == 0
    # They were decoded together: one decode step advances many rows, so the steps taken are a
    # small fraction of the tokens produced (one request at a time would need a step per token).
    steps = after["counters"]["decode_steps"] - before.get("decode_steps", 0)
    tokens = after["counters"]["tokens"] - before.get("tokens", 0)
    assert tokens == sum(budgets)
    assert steps * 8 < tokens, f"{steps} decode steps for {tokens} tokens: the requests were not batched"
    assert after["counters"]["peak_running"] >= 64


def test_bad_requests_get_4xx_with_a_message(server, tiny_tokenizer):
    async def run(client):
        errors = []
        for prompt, params in (
            ([5] * 600, {"max_tokens": 4}),
            ([10**6], {"max_tokens": 4}),
            ([5, 6], {"max_tokens": 4, "best_of_everything": 3}),
            ([5, 6], {"max_tokens": 4, "repetition_penalty": 1.3}),
        ):
            with pytest.raises(aiohttp.ClientResponseError) as info:
                await generate(client, [prompt], **params)
            errors.append(info.value)
        return errors

    too_long, bad_id, unknown, unsupported = with_client(server, tiny_tokenizer, run)
    assert too_long.status == 400 and "maximum context length is 512" in too_long.message
    assert bad_id.status == 400 and "token ids must lie in" in bad_id.message
    assert unknown.status == 400 and "best_of_everything" in unknown.message
    assert unsupported.status == 400 and "repetition_penalty" in unsupported.message
    # The server is still healthy afterwards.
    assert asyncio.run(post(f"{server.url}/health", method="GET"))[0] == 200


def test_pause_keep_freezes_and_holds_until_resume(server, tiny_tokenizer, prompts):
    async def run(client):
        running = asyncio.create_task(
            generate(client, prompts[:1], max_tokens=450, min_tokens=450, logprobs=0)
        )
        await until_running(server)
        await client.pause(mode="keep")
        frozen_at = (await stats(server))["counters"]["tokens"]
        held = asyncio.create_task(generate(client, prompts[1:2], max_tokens=4, min_tokens=4))
        await wait_for(server, lambda s: s["waiting"] == 1, "the new request to queue behind the pause")
        await generation_thread_turns(client)
        state = await stats(server)
        pending = not running.done() and not held.done()
        await client.resume()
        return frozen_at, state, pending, await running, await held

    frozen_at, state, pending, running, held = with_client(server, tiny_tokenizer, run)
    assert pending and state["paused"] and state["running"] == 1 and state["waiting"] == 1
    assert state["counters"]["tokens"] == frozen_at, "tokens were decoded while paused with mode=keep"
    assert running["stop_reasons"] == ["length"] and len(running["response_ids"][0]) == 450
    assert len(running["response_logprobs"][0]) == 450
    assert held["stop_reasons"] == ["length"] and len(held["response_ids"][0]) == 4


def test_pause_abort_returns_partial_output(server, tiny_tokenizer, prompts):
    async def run(client):
        running = asyncio.create_task(generate(client, prompts[:1], max_tokens=450, min_tokens=450))
        await until_running(server)
        await client.pause(mode="abort")
        aborted = await asyncio.wait_for(running, timeout=30)
        held = asyncio.create_task(generate(client, prompts[:1], max_tokens=3, min_tokens=3))
        await wait_for(server, lambda s: s["waiting"] == 1, "the new request to queue behind the pause")
        await generation_thread_turns(client)
        state = await stats(server)
        was_held = not held.done() and state["paused"] and state["running"] == 0 and state["waiting"] == 1
        await client.resume()
        return aborted, was_held, await held

    aborted, was_held, after = with_client(server, tiny_tokenizer, run)
    assert aborted["stop_reasons"] == ["abort"] and 1 <= len(aborted["response_ids"][0]) < 450
    assert was_held and after["stop_reasons"] == ["length"]


def test_pause_wait_lets_running_requests_finish(server, tiny_tokenizer, prompts):
    async def run(client):
        running = asyncio.create_task(generate(client, prompts[:1], max_tokens=60, min_tokens=60))
        await until_running(server)
        await client.pause(mode="wait")  # returns once the running request is done
        drained = await stats(server)
        finished = await asyncio.wait_for(running, timeout=30)
        held = asyncio.create_task(generate(client, prompts[1:2], max_tokens=3, min_tokens=3))
        await wait_for(server, lambda s: s["waiting"] == 1, "a new request to queue behind the pause")
        await generation_thread_turns(client)
        state = await stats(server)
        pending = not held.done()
        await client.resume()
        return drained, finished, state, pending, await held

    drained, finished, state, pending, held = with_client(server, tiny_tokenizer, run)
    assert drained["paused"] and drained["running"] == 0 and drained["waiting"] == 0
    assert finished["stop_reasons"] == ["length"] and len(finished["response_ids"][0]) == 60
    assert pending and state["paused"] and state["running"] == 0 and state["waiting"] == 1
    assert held["stop_reasons"] == ["length"] and len(held["response_ids"][0]) == 3


def test_sleep_and_wake_up(server, tiny_tokenizer, prompts):
    async def run(client):
        await client.sleep(level=1)
        asleep = await client.is_sleeping()
        held = asyncio.create_task(generate(client, prompts[:1], max_tokens=2, min_tokens=2))
        await wait_for(server, lambda s: s["waiting"] == 1, "the new request to queue while asleep")
        await generation_thread_turns(client, asleep=True)
        state = await stats(server)
        was_held = not held.done() and state["running"] == 0 and state["waiting"] == 1 and state["sleeping"]
        await client.wake_up(tags=["weights"])
        still_asleep = await client.is_sleeping()
        await client.wake_up(tags=["kv_cache"])
        return asleep, was_held, still_asleep, await client.is_sleeping(), await held

    asleep, was_held, still_asleep, awake_now, result = with_client(server, tiny_tokenizer, run)
    assert asleep and was_held and still_asleep and not awake_now
    assert len(result["response_ids"][0]) == 2


def test_control_and_info_endpoints(server, tiny_tokenizer):
    async def run(client):
        return (
            await client.get_world_size(),
            await client.reset_prefix_cache(),
            await post(f"{server.url}/v1/models", method="GET"),
            await post(f"{server.url}/update_weights", {}),
        )

    world, reset, (_, models), (gpu_status, gpu_error) = with_client(server, tiny_tokenizer, run)
    assert world == (1, 1)
    assert reset[server.url]["status"] == 200
    assert models["data"][0]["id"] == server.served_model_name and models["data"][0]["max_model_len"] == 512
    assert gpu_status == 501 and "/rllm_skyrl/v1/load_weights" in gpu_error["error"]["message"]


def test_connections_send_without_nagle_delay(server):
    # A response is two writes (headers, body): with Nagle on, the body waits for the client's
    # delayed ACK of the headers, 40 ms on Linux. The server's own end of the connection is read.
    connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().read() is not None  # the connection stays open (keep-alive)
        accepted = [c.transport.get_extra_info("socket") for c in server._uvicorn.server_state.connections]
        assert accepted
        assert all(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for sock in accepted)
    finally:
        connection.close()


def test_full_weight_reload_changes_logprobs(
    server, tiny_tokenizer, prompts, hf_model, tiny_model_dir, weights_root
):
    from transformers import AutoModelForCausalLM

    perturbed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(0.05 * torch.randn_like(param))
    perturbed.save_pretrained(weights_root / "step1")
    sampling = dict(max_tokens=12, min_tokens=12, temperature=1.0, logprobs=0)

    async def run(client):
        status, loaded = await post(
            f"{server.url}/rllm_skyrl/v1/load_weights",
            {"path": str(weights_root / "step1"), "weight_version": 7},
        )
        _, version = await post(f"{server.url}/rllm_skyrl/v1/weight_version", method="GET")
        out = await generate(client, prompts, **sampling)
        await post(
            f"{server.url}/rllm_skyrl/v1/load_weights",
            {"path": str(weights_root / "base"), "weight_version": 0},
        )
        return status, loaded, version, out

    status, loaded, version, out = with_client(server, tiny_tokenizer, run)
    assert status == 200 and loaded["weight_version"] == 7 and version["weight_version"] == 7
    old_diff = []
    for prompt, ids, lps in zip(prompts, out["response_ids"], out["response_logprobs"], strict=True):
        assert max_abs_diff(hf_logprobs(perturbed, prompt, ids, 1.0), lps) <= LOGPROB_TOLERANCE
        old_diff.append((hf_logprobs(hf_model, prompt, ids, 1.0) - torch.tensor(lps)).abs())
    assert torch.cat(old_diff).mean() > 1e-2


def test_load_weights_rejects_a_different_architecture(server, weights_root):
    from rllm_skyrl.tiny_model import TinyModelConfig, build_tiny_model

    other = build_tiny_model(
        TinyModelConfig(hidden_size=32, intermediate_size=64), cache_dir=weights_root / "other"
    )
    status, body = asyncio.run(post(f"{server.url}/rllm_skyrl/v1/load_weights", {"path": str(other)}))
    assert status == 400 and "shape mismatch" in body["error"]["message"]
    status, body = asyncio.run(
        post(f"{server.url}/rllm_skyrl/v1/load_weights", {"path": str(weights_root / "nope")})
    )
    assert status == 400 and "not a directory" in body["error"]["message"]


def test_lora_adapter_load_generate_unload(
    server, tiny_tokenizer, prompts, hf_model, tiny_model_dir, weights_root
):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    lora = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ).eval()
    lora.save_pretrained(weights_root / "adapter")
    sampling = dict(max_tokens=8, min_tokens=8, logprobs=0)

    async def run(client):
        # A base-model request already decoding keeps using the base weights while the adapter loads.
        long_base = asyncio.create_task(
            generate(client, prompts[:1], max_tokens=200, min_tokens=200, logprobs=0)
        )
        await until_running(server)
        await client.load_lora_adapter("skyrl-lora", str(weights_root / "adapter"))
        tuned = await client.generate(
            {"prompt_token_ids": prompts[:2], "sampling_params": sampling}, model="skyrl-lora"
        )
        plain = await generate(client, prompts[:2], **sampling)
        base = await long_base
        plain["response_ids"] += base["response_ids"]
        plain["response_logprobs"] += base["response_logprobs"]
        await client.unload_lora_adapter("skyrl-lora")
        with pytest.raises(aiohttp.ClientResponseError) as gone:
            await client.generate(
                {"prompt_token_ids": prompts[:1], "sampling_params": sampling}, model="skyrl-lora"
            )
        return tuned, plain, gone.value

    tuned, plain, gone = with_client(server, tiny_tokenizer, run)
    for prompt, ids, lps in zip(prompts, tuned["response_ids"], tuned["response_logprobs"], strict=False):
        assert max_abs_diff(hf_logprobs(lora, prompt, ids, 1.0), lps) <= LOGPROB_TOLERANCE
    plain_prompts = [*prompts[:2], prompts[0]]
    for prompt, ids, lps in zip(
        plain_prompts, plain["response_ids"], plain["response_logprobs"], strict=True
    ):
        assert max_abs_diff(hf_logprobs(hf_model, prompt, ids, 1.0), lps) <= LOGPROB_TOLERANCE
    assert gone.status == 404


def test_openai_chat_and_completions(server, tiny_tokenizer):
    async def run(client):
        chat = await client.chat_completion(
            {
                "json": {
                    "messages": [{"role": "user", "content": "what is 2 plus 2?"}],
                    "max_tokens": 6,
                    "n": 2,
                    "seed": 3,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "return_token_ids": True,
                }
            }
        )
        text = await client.completion({"json": {"prompt": "what is 1 plus", "max_tokens": 5, "logprobs": 1}})
        return chat, text

    chat, text = with_client(server, tiny_tokenizer, run)
    assert chat["object"] == "chat.completion" and len(chat["choices"]) == 2
    for choice in chat["choices"]:
        ids = choice["token_ids"]
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == tiny_tokenizer.decode(ids, skip_special_tokens=True)
        assert len(choice["logprobs"]["content"]) == len(ids)
        assert all(len(entry["top_logprobs"]) == 2 for entry in choice["logprobs"]["content"])
    assert chat["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in chat["choices"])
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_token_ids"])
    choice = text["choices"][0]
    assert text["object"] == "text_completion" and isinstance(choice["text"], str)
    assert len(choice["logprobs"]["token_logprobs"]) == text["usage"]["completion_tokens"]


def test_cli_serves_on_a_free_port(tiny_model_dir):
    proc = subprocess.Popen(
        [sys.executable, "-m", "rllm_skyrl.inference", "--model", tiny_model_dir, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        url = line.strip().rsplit(" ", 1)[-1]
        status, body = asyncio.run(post(f"{url}/health", method="GET"))
        assert status == 200 and body == {"status": "ok"}
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_reload_unties_embeddings_the_trainer_trained_apart(
    tiny_tokenizer, prompts, tied_tiny_model_dir, tmp_path
):
    """A checkpoint whose tied lm_head and embedding were trained apart (SkyRL's FSDP set-up
    without ``compat/tied_embeddings.py``): the server must serve what it was sent."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tiny_model_dir = str(tmp_path / "base")  # under the server's weights root, to restore it from
    shutil.copytree(tied_tiny_model_dir, tiny_model_dir)
    untied_dir = tmp_path / "untied"
    tied = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tied.save_pretrained(untied_dir)
    state = load_file(untied_dir / "model.safetensors")
    torch.manual_seed(1)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 0.1 * torch.randn_like(
        state["model.embed_tokens.weight"]
    )
    save_file(state, untied_dir / "model.safetensors", metadata={"format": "pt"})

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reference.lm_head.weight = torch.nn.Parameter(state["lm_head.weight"].clone())
    reference.config.tie_word_embeddings = False
    assert not torch.equal(reference.lm_head.weight, reference.model.embed_tokens.weight)
    sampling = dict(max_tokens=8, min_tokens=8, temperature=1.0, logprobs=0)

    async def run(client):
        status, _ = await post(f"{server.url}/rllm_skyrl/v1/load_weights", {"path": str(untied_dir)})
        out = await generate(client, prompts, **sampling)
        restored, _ = await post(f"{server.url}/rllm_skyrl/v1/load_weights", {"path": tiny_model_dir})
        return status, out, restored

    with InferenceServer(tiny_model_dir, weights_root=tmp_path) as server:
        status, out, restored = with_client(server, tiny_tokenizer, run)
    assert status == 200 and restored == 200  # the tied original (lm_head saved once) still loads
    for prompt, ids, lps in zip(prompts, out["response_ids"], out["response_logprobs"], strict=True):
        assert max_abs_diff(hf_logprobs(reference, prompt, ids, 1.0), lps) <= LOGPROB_TOLERANCE
