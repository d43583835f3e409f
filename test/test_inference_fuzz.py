"""A seeded fuzz campaign against the CPU inference server, on loopback.

Well over a thousand malformed requests (wrong types, huge integers, NaN/inf, negative and out-of-range
values, unknown fields, broken JSON, oversized bodies, bad token ids, bad routes, missing credentials)
are interleaved with healthy ones and sent 32 at a time. Every malformed request must get a 4xx
(never a 5xx), every healthy one a 200 with exactly the tokens it gets when sent alone, and the
server must be serving afterwards with nothing left queued or running.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import shutil
import time

import httpx
import pytest
import torch

from rllm_skyrl.inference import InferenceServer

TOKEN = "fuzz-token-0123456789abcdefghij"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
SEED = 20240611
MALFORMED, HEALTHY, CONCURRENCY = 2000, 320, 32
BODY_LIMIT = 64 << 10

_BAD_INT = [2**63, 2**64, -(2**63) - 1, 10**30, 1.5, "7", True, [], {}]
_BAD_FLOAT = ["x", "0.5", True, [], {}]
_BAD_BOOL = ["false", "true", 0, 1, "no", [], {}]
# Values each sampling field must refuse (null is not among them: it means "default").
BAD_SAMPLING = {
    "max_tokens": [*_BAD_INT, 0, -1],
    "min_tokens": [*_BAD_INT, -1],
    "top_k": [*_BAD_INT, -2],
    "seed": _BAD_INT,
    "logprobs": [v for v in _BAD_INT if v is not True] + [-1, 21],
    "temperature": [*_BAD_FLOAT, -0.1],
    "top_p": [*_BAD_FLOAT, 0, 1.5, -0.5],
    "min_p": [*_BAD_FLOAT, -0.2, 1.5],
    "ignore_eos": _BAD_BOOL,
    "skip_special_tokens": _BAD_BOOL,
    "include_stop_str_in_output": _BAD_BOOL,
    "stop": [5, {"a": 1}, [None], [""], ["x" * 2000], ["s"] * 100],
    "stop_token_ids": [5, "x", [None], [-1], [2**63], [1.5], [True]],
}


def healthy_requests(prompts: list[list[int]]) -> list[dict]:
    """Seeded or greedy requests: the same tokens whatever they are batched with."""
    variants = [
        {"temperature": 0.0, "max_tokens": 8},
        {"temperature": 1.0, "seed": 11, "max_tokens": 10, "min_tokens": 10},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 5, "max_tokens": 6},
    ]
    return [
        {"token_ids": prompt, "sampling_params": {**params, "logprobs": 0}}
        for prompt in prompts
        for params in variants
    ]


def malformed_requests(rng: random.Random, prompt: list[int], vocab: int, count: int) -> list[tuple]:
    """``(kind, method, path, body_bytes, headers)`` cases; each kind is a family of mistakes."""
    base = {"token_ids": prompt, "sampling_params": {"max_tokens": 4}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    def dumps(body) -> bytes:
        return json.dumps(body).encode()

    def sampling_field():
        name = rng.choice(list(BAD_SAMPLING))
        value = rng.choice(BAD_SAMPLING[name])
        return "POST", "/inference/v1/generate", dumps({**base, "sampling_params": {name: value}})

    def non_finite():
        name = rng.choice(["temperature", "top_p", "min_p", "max_tokens"])
        number = rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
        return (
            "POST",
            "/inference/v1/generate",
            f'{{"token_ids": {prompt}, "sampling_params": {{"{name}": {number}}}}}'.encode(),
        )

    def unknown_field():
        name = rng.choice(["best_of_everything", "foo", "temprature", "topk", "__class__", ""])
        return "POST", "/inference/v1/generate", dumps({**base, "sampling_params": {name: 1}})

    def unsupported_value():
        name, value = rng.choice(
            [
                ("n", 129),
                ("n", 0),
                ("repetition_penalty", 1.3),
                ("presence_penalty", float("1e3")),
                ("logit_bias", {"5": 1}),
                ("best_of", 3),
                ("guided_decoding", {"json": {}}),
            ]
        )
        return "POST", "/inference/v1/generate", dumps({**base, "sampling_params": {name: value}})

    def bad_json():
        body = rng.choice(
            [
                b"{",
                b'{"token_ids": [1, 2,]}',
                b"[1, 2, 3]",
                b'"text"',
                b"5",
                b"null",
                b"\xff\xfe\x00",
                b'{"token_ids": [1] } trailing',
                b"{'single': 'quotes'}",
                b'{"a": "\\ud800"}',
            ]
        )
        return "POST", rng.choice(["/inference/v1/generate", "/v1/chat/completions", "/tokenize"]), body

    def oversized():
        filler = rng.choice([BODY_LIMIT + 1, BODY_LIMIT * 2])
        return "POST", "/inference/v1/generate", dumps({**base, "pad": "x" * filler})

    def bad_token_ids():
        ids = rng.choice(
            [
                [],
                [-1],
                [vocab],
                [vocab + 10**6],
                [1.5],
                ["a"],
                [[1]],
                [True],
                None,
                "abc",
                5,
                {"a": 1},
                [2**63],
                prompt * 40,
                [10**30],
            ]
        )
        return "POST", "/inference/v1/generate", dumps({**base, "token_ids": ids})

    def bad_sampling_container():
        return "POST", "/inference/v1/generate", dumps({**base, "sampling_params": rng.choice([5, "x", [1]])})

    def bad_chat():
        body = rng.choice(
            [
                {**chat, "messages": "hi"},
                {**chat, "messages": []},
                {**chat, "messages": [5]},
                {**chat, "n": 0},
                {**chat, "n": "2"},
                {**chat, "n": 10**6},
                {**chat, "chat_template": "{{ messages }}"},
                {**chat, "chat_template_kwargs": {"chat_template": "x"}},
                {**chat, "chat_template_kwargs": "x"},
                {**chat, "logprobs": "true"},
                {**chat, "logprobs": True, "top_logprobs": 50},
                {**chat, "max_tokens": 0},
                {**chat, "max_completion_tokens": -4},
                {**chat, "stream": True},
                {**chat, "tools": "x"},
                {**chat, "model": "no-such-model"},
                {**chat, "model": ["x"]},
                {**chat, "temperature": "hot"},
                {**chat, "add_generation_prompt": "yes"},
            ]
        )
        return "POST", "/v1/chat/completions", dumps(body)

    def bad_completion():
        body = rng.choice(
            [
                {"prompt": None},
                {"prompt": []},
                {"prompt": [1, "a"]},
                {"prompt": [[]]},
                {"prompt": "hi", "n": 0},
                {"prompt": "hi", "echo": True, "max_tokens": -1},
                {"prompt": "hi", "logprobs": 99},
                {"prompt": [vocab]},
            ]
        )
        return "POST", "/v1/completions", dumps(body)

    def bad_text_routes():
        path, body = rng.choice(
            [
                ("/detokenize", {"tokens": [1e30]}),
                ("/detokenize", {"tokens": [-1]}),
                ("/detokenize", {"tokens": "x"}),
                ("/detokenize", {}),
                ("/tokenize", {}),
                ("/tokenize", {"prompt": 5}),
                ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}),
                ("/tokenize", {"messages": 3}),
            ]
        )
        return "POST", path, dumps(body)

    def bad_control():
        method, path, body = rng.choice(
            [
                ("POST", "/pause?mode=forever", None),
                ("POST", "/sleep?level=9", None),
                ("POST", "/sleep?level=x", None),
                ("POST", "/rllm_skyrl/v1/load_weights", {"path": "/etc"}),
                ("POST", "/rllm_skyrl/v1/load_weights", {"path": "../../etc"}),
                ("POST", "/rllm_skyrl/v1/load_weights", {"path": 5}),
                ("POST", "/rllm_skyrl/v1/load_weights", {"path": "/tmp", "weight_version": "7"}),
                ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/etc"}),
                ("POST", "/v1/load_lora_adapter", {"lora_name": 5}),
                ("POST", "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}),
                ("GET", "/no/such/route", None),
                ("DELETE", "/health", None),
                ("GET", "/inference/v1/generate", None),
            ]
        )
        return method, path, dumps(body) if body is not None else b""

    def unauthenticated():
        method, path, body = rng.choice(
            [
                ("POST", "/inference/v1/generate", dumps(base)),
                ("POST", "/pause?mode=abort", b""),
                ("POST", "/sleep", b""),
                ("POST", "/rllm_skyrl/v1/load_weights", dumps({"path": "/etc"})),
            ]
        )
        headers = rng.choice([{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic !!"}])
        return method, path, body, {"Content-Type": "application/json", **headers}

    families = [
        sampling_field,
        sampling_field,
        sampling_field,
        sampling_field,
        non_finite,
        unknown_field,
        unsupported_value,
        bad_json,
        oversized,
        bad_token_ids,
        bad_token_ids,
        bad_sampling_container,
        bad_chat,
        bad_chat,
        bad_completion,
        bad_text_routes,
        bad_control,
        unauthenticated,
    ]
    cases = []
    for _ in range(count):
        family = rng.choice(families)
        method, path, body, *headers = family()
        cases.append((family.__name__, method, path, body, headers[0] if headers else AUTH))
    return cases


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_root")
    shutil.copytree(tiny_model_dir, root / "base")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with InferenceServer(tiny_model_dir, token=TOKEN, weights_root=root, max_body_bytes=BODY_LIMIT) as srv:
        yield srv
    torch.set_num_threads(threads)


def test_fuzz_campaign(server, tiny_tokenizer):
    rng = random.Random(SEED)
    questions = ["what is 3 plus 4?", "hello", "solve: what is 9 plus 9? think step by step", "yes"]
    prompts = [
        tiny_tokenizer.encode(
            tiny_tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q in questions
    ]
    templates = healthy_requests(prompts)
    vocab = server.service.scheduler.vocab_size
    cases = malformed_requests(rng, prompts[0], vocab, MALFORMED)
    healthy = [rng.randrange(len(templates)) for _ in range(HEALTHY)]
    work = [("malformed", case) for case in cases] + [("healthy", index) for index in healthy]
    rng.shuffle(work)

    async def campaign():
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            alone = []
            for template in templates:  # the reference: each healthy request sent on its own
                response = await client.post("/inference/v1/generate", json=template, headers=AUTH)
                assert response.status_code == 200, response.text
                alone.append(response.json()["choices"][0]["token_ids"])
            statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
            failures: list[str] = []
            queue: asyncio.Queue = asyncio.Queue()
            for item in work:
                queue.put_nowait(item)

            async def worker():
                while not queue.empty():
                    kind, item = queue.get_nowait()
                    if kind == "healthy":
                        response = await client.post(
                            "/inference/v1/generate", json=templates[item], headers=AUTH
                        )
                        statuses["healthy"][response.status_code] += 1
                        if response.status_code != 200:
                            failures.append(
                                f"healthy {templates[item]} -> {response.status_code}: {response.text}"
                            )
                        elif response.json()["choices"][0]["token_ids"] != alone[item]:
                            failures.append(
                                f"healthy {templates[item]['sampling_params']} changed its tokens in a crowd"
                            )
                        continue
                    family, method, path, body, headers = item
                    try:
                        response = await client.request(method, path, content=body, headers=headers)
                    except httpx.TransportError as error:
                        failures.append(f"{family} {method} {path} {body[:200]!r} -> {error!r}")
                        continue
                    statuses[family][response.status_code] += 1
                    if not 400 <= response.status_code < 500:
                        failures.append(
                            f"{family} {method} {path} {body[:200]!r} -> {response.status_code}: "
                            f"{response.text[:300]}"
                        )

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
            elapsed = time.perf_counter() - start
            state = (await client.get("/rllm_skyrl/v1/stats", headers=AUTH)).json()
            health = (await client.get("/health")).status_code
            return statuses, failures, elapsed, state, health

    statuses, failures, elapsed, state, health = asyncio.run(campaign())
    totals = collections.Counter()
    for counter in statuses.values():
        totals.update(counter)
    summary = (
        f"fuzz: {MALFORMED} malformed + {HEALTHY} healthy requests, {CONCURRENCY}-way, {elapsed:.1f} s; "
        f"statuses {dict(sorted(totals.items()))}; per family "
        + "; ".join(f"{k} {dict(sorted(v.items()))}" for k, v in sorted(statuses.items()))
    )
    print(summary)
    assert not failures, f"{len(failures)} failures, first: {failures[:5]}\n{summary}"
    assert sum(statuses["healthy"].values()) == HEALTHY and statuses["healthy"][200] == HEALTHY
    assert sum(v for k, c in statuses.items() if k != "healthy" for v in c.values()) == MALFORMED
    assert health == 200 and state["running"] == 0 and state["waiting"] == 0, state
    assert not state["paused"] and not state["sleeping"], state
