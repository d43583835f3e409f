"""The CPU inference server against hostile or broken clients: the token, the weights root, checks
at the door (one bad request never fails another), keep-alive after errors, templating off the
event loop, body and queue limits, and cancellation of requests whose client went away."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from http.client import HTTPConnection

import aiohttp
import httpx
import pytest
import torch
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient

from rllm_skyrl.inference import InferenceServer
from rllm_skyrl.inference.checks import shown
from rllm_skyrl.inference.http_server import PortInUseError
from rllm_skyrl.inference.routes import build_app

TOKEN = "test-token-0123456789abcdefghijklmnop"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY_LIMIT = 1 << 20


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(tiny_model_dir, root / "base")
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dir, weights_root):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with InferenceServer(
        tiny_model_dir, token=TOKEN, weights_root=weights_root, max_body_bytes=BODY_LIMIT
    ) as srv:
        yield srv
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def prompt(tiny_tokenizer) -> list[int]:
    text = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 3 plus 4?"}], tokenize=False, add_generation_prompt=True
    )
    return tiny_tokenizer.encode(text, add_special_tokens=False)


def error_of(response: httpx.Response) -> str:
    return response.json()["error"]["message"]


def gen_body(prompt: list[int], **sampling) -> dict:
    return {"token_ids": prompt, "sampling_params": sampling}


async def wait_for_stats(server, predicate, what: str, timeout: float = 60.0) -> dict:
    """Poll the server's own state (not the clock) until ``predicate`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as client:
        while True:
            stats = (await client.get("/rllm_skyrl/v1/stats")).json()
            if predicate(stats):
                return stats
            if loop.time() > deadline:
                raise AssertionError(f"waited {timeout:.0f} s for {what}; server state: {stats}")
            await asyncio.sleep(0.002)


# ----------------------------------------------------------------------------------------- token
def test_every_route_but_health_needs_the_token(server, api):
    routes = [
        (method, route.path)
        for route in build_app(server.service).routes
        for method in sorted(getattr(route, "methods", None) or ())
        if method != "HEAD"
    ]
    assert len(routes) >= 20 and ("POST", "/rllm_skyrl/v1/load_weights") in routes
    wrong_basic = "Basic " + base64.b64encode(b"rllm:not-the-token").decode()
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": wrong_basic}):
                response = anonymous.request(method, path, headers=headers, json={})
                if path == "/health":
                    assert response.status_code == 200
                    continue
                assert response.status_code == 401, (method, path, headers, response.status_code)
                assert response.json()["error"]["type"] == "AuthenticationError"
                assert response.headers["www-authenticate"].startswith("Bearer")
        right_basic = "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
        assert (
            anonymous.get("/rllm_skyrl/v1/stats", headers={"Authorization": right_basic}).status_code == 200
        )
    assert api.get("/rllm_skyrl/v1/stats").status_code == 200


def test_skyrl_client_works_with_credentials_in_the_url_and_not_without(server, tiny_tokenizer, prompt):
    host = server.url.removeprefix("http://")
    with_token = f"http://rllm:{TOKEN}@{host}"

    async def drive(url: str):
        async with RemoteInferenceClient(
            proxy_url=url, server_urls=[url], data_parallel_size=1, tokenizer=tiny_tokenizer
        ) as client:
            out = await client.generate(
                {"prompt_token_ids": [prompt], "sampling_params": {"max_tokens": 3, "min_tokens": 3}}
            )
            await client.pause(mode="keep")
            await client.resume()
            return out

    out = asyncio.run(drive(with_token))
    assert len(out["response_ids"][0]) == 3
    for url in (server.url, f"http://rllm:wrong@{host}"):
        with pytest.raises(aiohttp.ClientResponseError) as refused:
            asyncio.run(drive(url))
        assert refused.value.status == 401


# ---------------------------------------------------------------------------------- weights root
def test_weights_load_only_from_under_the_root(server, api, weights_root, tiny_model_dir, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(tiny_model_dir, outside)
    (weights_root / "link").symlink_to(outside)
    attempts = {
        "existing dir outside": str(outside),
        "missing dir outside": str(tmp_path / "missing"),
        "a file outside": "/etc/passwd",
        "dot-dot escape": f"{weights_root}/../{tmp_path.name}/outside",
        "symlink out of the root": str(weights_root / "link"),
        "relative path": "base",
    }
    messages = {}
    for what, path in attempts.items():
        response = api.post("/rllm_skyrl/v1/load_weights", json={"path": path})
        assert response.status_code == 400, what
        messages[what] = error_of(response).replace(shown(path), "<path>")
        assert messages[what].startswith(f"path outside {weights_root.resolve()}"), (what, messages[what])
    # The answer is the same whether the path exists or not: the server cannot be used to probe.
    assert len(set(messages.values())) == 1, messages
    assert (
        api.post("/rllm_skyrl/v1/load_weights", json={"path": str(weights_root / "base")}).status_code == 200
    )


def test_index_shards_and_weight_files_may_not_leave_the_root(
    server, api, weights_root, tiny_model_dir, tmp_path, monkeypatch
):
    import safetensors.torch

    opened = []
    real_load_file = safetensors.torch.load_file
    monkeypatch.setattr(
        safetensors.torch, "load_file", lambda p, *a, **k: opened.append(str(p)) or real_load_file(p, *a, **k)
    )
    secret = tmp_path / "secret.safetensors"
    shutil.copy(os.path.join(tiny_model_dir, "model.safetensors"), secret)
    for name, shard in (("absolute", str(secret)), ("dotdot", f"../../{tmp_path.name}/secret.safetensors")):
        bad = weights_root / f"index-{name}"
        bad.mkdir()
        (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
        response = api.post("/rllm_skyrl/v1/load_weights", json={"path": str(bad)})
        assert response.status_code == 400 and "leaves that directory" in error_of(response), name
    linked = weights_root / "linked-file"
    linked.mkdir()
    (linked / "model.safetensors").symlink_to(secret)
    response = api.post("/rllm_skyrl/v1/load_weights", json={"path": str(linked)})
    assert response.status_code == 400 and error_of(response).startswith("path outside")
    assert opened == [], f"files were opened despite the refusals: {opened}"
    # A torn checkpoint under the root is the caller's error (400), not the server's (500).
    torn = weights_root / "torn"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"not a safetensors file")
    response = api.post("/rllm_skyrl/v1/load_weights", json={"path": str(torn)})
    assert response.status_code == 400 and "could not read the weights" in error_of(response)


def test_lora_adapters_load_only_from_under_the_root(server, api, weights_root, tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "adapter")
    response = api.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "adapter")}
    )
    assert response.status_code == 400 and error_of(response).startswith("path outside")
    inside = weights_root / "adapter-with-link"
    inside.mkdir()
    shutil.copy(tmp_path / "adapter" / "adapter_config.json", inside)
    (inside / "adapter_model.safetensors").symlink_to(tmp_path / "adapter" / "adapter_model.safetensors")
    response = api.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(inside)})
    assert response.status_code == 400 and error_of(response).startswith("path outside")
    assert api.get("/v1/models").json()["data"][1:] == []


def test_a_server_without_a_weights_root_loads_nothing(tiny_model_dir):
    with InferenceServer(tiny_model_dir) as srv:
        response = httpx.post(f"{srv.url}/rllm_skyrl/v1/load_weights", json={"path": tiny_model_dir})
    assert response.status_code == 400 and "--weights-root" in error_of(response)


def test_a_non_loopback_server_needs_a_token(tiny_model_dir):
    with pytest.raises(ValueError, match="without a token"):
        InferenceServer(tiny_model_dir, host="0.0.0.0")


# ------------------------------------------------------------------------------ checks at the door
BAD_SAMPLING = [
    ({"top_k": 2**63}, "top_k must be an integer in [-1, 2147483647]"),
    ({"top_k": 1.5}, "top_k must be an integer"),
    ({"min_tokens": 2**63}, "min_tokens must be an integer in [0, 2147483647]"),
    ({"max_tokens": 0}, "max_tokens must be an integer in [1, 2147483647]"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"top_p": "x"}, "top_p must be a finite number in (0.0, 1.0]"),
    ({"top_p": 0}, "top_p must be a finite number in (0.0, 1.0]"),
    ({"temperature": -1}, "temperature must be a finite number"),
    ({"min_p": 2}, "min_p must be a finite number in [0.0, 1.0]"),
    ({"seed": 2**64}, "seed must be an integer"),
    ({"stop": 5}, "stop must be a string or a list"),
    ({"stop": [""]}, "stop must hold non-empty strings"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must hold integers in [0, 2147483647]"),
    ({"stop_token_ids": "1"}, "stop_token_ids must be a list"),
    ({"ignore_eos": "false"}, "ignore_eos must be true or false"),
    ({"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ({"n": 0}, "n must be an integer in [1, 128], got 0"),
    ({"n": 129}, "n must be an integer in [1, 128], got 129"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens (3) exceeds max_tokens (2)"),
    ({"surprise": 1}, "unknown sampling param 'surprise'"),
]


@pytest.mark.parametrize(("sampling", "message"), BAD_SAMPLING, ids=[str(s) for s, _ in BAD_SAMPLING])
def test_bad_sampling_params_get_400_naming_the_field(api, prompt, sampling, message):
    response = api.post("/inference/v1/generate", json=gen_body(prompt, **sampling))
    assert response.status_code == 400, response.text
    assert message in error_of(response)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_bad_json(api, prompt, number):
    body = json.dumps(gen_body(prompt, max_tokens=2)).replace('"max_tokens": 2', f'"temperature": {number}')
    response = api.post("/inference/v1/generate", content=body.encode())
    assert response.status_code == 400 and "not valid JSON" in error_of(response)


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n must be"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"},
            "logprobs",
        ),
        ("/v1/chat/completions", {"messages": "hi"}, "messages must be a non-empty list"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 1 }}"},
            "chat_template",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": "x"}},
            "chat_template_kwargs may not set ['chat_template']",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
            "max_tokens",
        ),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt must be"),
        ("/v1/completions", {"prompt": "hi", "n": 10**6}, "n must be"),
        ("/detokenize", {"tokens": [1e30]}, "tokens must hold integers"),
        ("/detokenize", {"tokens": [10**6]}, "tokens must hold integers"),
        (
            "/tokenize",
            {"prompt": "hi", "add_special_tokens": "no"},
            "add_special_tokens must be true or false",
        ),
        ("/inference/v1/generate", {"token_ids": [True, 5]}, "token_ids must be a list of integers"),
        ("/inference/v1/generate", {"token_ids": [5], "model": ["x"]}, "model must be a string"),
        ("/rllm_skyrl/v1/load_weights", {"path": "/x", "weight_version": "7"}, "weight_version"),
    ],
)
def test_bad_fields_get_400_naming_them(api, route, body, message):
    response = api.post(route, json=body)
    assert response.status_code == 400, response.text
    assert message in error_of(response)


def test_bad_query_parameters_get_400(api):
    assert api.post("/sleep", params={"level": "deep"}).status_code == 400
    assert api.post("/pause", params={"mode": "forever"}).status_code == 400


def test_a_bad_request_never_fails_the_batch_it_would_join(server, prompt):
    """With a healthy request decoding, requests whose values would overflow a batched tensor
    are refused alone; the healthy one finishes as if they never came."""

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            healthy = asyncio.create_task(
                client.post("/inference/v1/generate", json=gen_body(prompt, max_tokens=400, min_tokens=400))
            )
            await wait_for_stats(server, lambda s: s["running"] >= 1, "the healthy request to run")
            bad = [
                await client.post("/inference/v1/generate", json=gen_body(prompt, top_k=2**63)),
                await client.post("/inference/v1/generate", json=gen_body(prompt, min_tokens=2**63)),
            ]
            return await healthy, bad

    healthy, bad = asyncio.run(run())
    assert [r.status_code for r in bad] == [400, 400]
    assert healthy.status_code == 200
    assert len(healthy.json()["choices"][0]["token_ids"]) == 400


def test_tiny_temperatures_report_finite_logprobs(api, prompt):
    """vLLM's rule: a temperature in (0, 0.01) samples at 0.01; logprobs are numbers, never null."""
    outs = [
        api.post(
            "/inference/v1/generate", json=gen_body(prompt, temperature=t, seed=5, max_tokens=8, logprobs=2)
        ).json()["choices"][0]
        for t in (1e-320, 0.01)
    ]
    lps = [[e["logprob"] for e in out["logprobs"]["content"]] for out in outs]
    assert all(isinstance(v, float) and math.isfinite(v) for v in lps[0])
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and lps[0] == lps[1]
    tops = [t["logprob"] for e in outs[0]["logprobs"]["content"] for t in e["top_logprobs"]]
    assert all(isinstance(v, float) and -9999.0 <= v <= 0 for v in tops)


# ------------------------------------------------------------------------------------ keep-alive
def test_the_connection_survives_4xx_and_5xx(server, prompt, monkeypatch):
    conn = HTTPConnection(server.url.removeprefix("http://"), timeout=60)
    headers = {"Content-Type": "application/json", **AUTH}

    def post(path: str, body: dict) -> int:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status

    good = gen_body(prompt, max_tokens=2)
    assert post("/inference/v1/generate", good) == 200
    sock = conn.sock
    assert post("/inference/v1/generate", gen_body(prompt, top_k=2**63)) == 400
    assert post("/inference/v1/generate", good) == 200 and conn.sock is sock
    monkeypatch.setattr(server.service, "resolve_model", lambda _: 1 / 0)
    assert post("/inference/v1/generate", good) == 500
    monkeypatch.undo()
    assert post("/inference/v1/generate", good) == 200 and conn.sock is sock
    conn.close()


# --------------------------------------------------------------------------------- event loop
@pytest.fixture(scope="module")
def roomy(tiny_model_dir):
    """A server with a body limit large enough for the heavy templating test."""
    with InferenceServer(tiny_model_dir, token=TOKEN, max_body_bytes=64 << 20) as srv:
        yield srv


def test_health_answers_while_a_heavy_chat_is_templated(roomy):
    """A heavy chat (a few MB of messages) is templated and tokenized on the templating thread;
    /health keeps answering meanwhile."""
    messages = [{"role": "user", "content": "hello there " * 8}] * 25_000
    payload = json.dumps({"messages": messages, "max_tokens": 1}).encode()

    async def run():
        latencies: list[float] = []
        async with httpx.AsyncClient(base_url=roomy.url, headers=AUTH, timeout=300) as client:
            start = time.perf_counter()
            heavy = asyncio.create_task(
                client.post(
                    "/v1/chat/completions", content=payload, headers={"Content-Type": "application/json"}
                )
            )
            await asyncio.sleep(0)
            while not heavy.done():
                sent = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                if not heavy.done():
                    latencies.append(time.perf_counter() - sent)
            return await heavy, time.perf_counter() - start, latencies

    heavy, duration, latencies = asyncio.run(run())
    assert heavy.status_code == 400 and "maximum context length" in error_of(heavy), heavy.text
    # Behavioural, not a stopwatch: a blocked event loop answers no /health until the chat is
    # done, so at most one or two answers could land inside it, however fast the machine.
    median = sorted(latencies)[len(latencies) // 2] if latencies else duration
    said = f"{len(latencies)} /health answers (median {median * 1000:.0f} ms) during a {duration:.2f} s chat"
    assert len(latencies) >= 5, f"only {said}"


# ----------------------------------------------------------------------------------------- limits
def test_oversized_bodies_get_413(server, prompt):
    big = json.dumps(gen_body(prompt, max_tokens=1)) + " " * BODY_LIMIT  # valid JSON, 1 MiB of spaces
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        declared = client.post("/inference/v1/generate", content=big.encode())
        chunked = client.post(
            "/inference/v1/generate",
            content=iter([big.encode()[i : i + 65536] for i in range(0, len(big), 65536)]),
        )
        assert declared.status_code == 413 and chunked.status_code == 413
        assert "exceeds 1048576 bytes" in error_of(declared)
        assert client.post("/inference/v1/generate", json=gen_body(prompt, max_tokens=1)).status_code == 200


def test_a_full_queue_answers_503_with_retry_after(tiny_model_dir, prompt):
    with InferenceServer(tiny_model_dir, token=TOKEN, max_waiting=2) as srv:

        async def run():
            async with httpx.AsyncClient(base_url=srv.url, headers=AUTH, timeout=120) as client:
                await client.post("/pause", params={"mode": "keep"})
                queued = [
                    asyncio.create_task(
                        client.post("/inference/v1/generate", json=gen_body(prompt, max_tokens=2))
                    )
                    for _ in range(2)
                ]
                await wait_for_stats(srv, lambda s: s["waiting"] == 2, "two queued requests")
                full = await client.post("/inference/v1/generate", json=gen_body(prompt, max_tokens=2))
                await client.post("/resume")
                await wait_for_stats(
                    srv, lambda s: s["waiting"] == 0 and s["running"] == 0, "the queue to drain"
                )
                await client.post("/pause", params={"mode": "keep"})
                one = asyncio.create_task(
                    client.post("/inference/v1/generate", json=gen_body(prompt, max_tokens=2))
                )
                await wait_for_stats(srv, lambda s: s["waiting"] == 1, "one queued request")
                # n=2 does not fit next to it: refused whole, nothing of it is queued.
                chat = await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2},
                )
                waiting = (await client.get("/rllm_skyrl/v1/stats")).json()["waiting"]
                await client.post("/resume")
                return full, [await q for q in queued], chat, waiting, await one

        full, queued, chat, waiting, one = asyncio.run(run())
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert "queue is full" in error_of(full)
    assert [q.status_code for q in queued] == [200, 200] and one.status_code == 200
    assert chat.status_code == 503 and waiting == 1


def test_a_disconnected_clients_request_is_cancelled(server, prompt):
    """The scheduler stops decoding a request once its client is gone."""
    body = json.dumps(gen_body(prompt, max_tokens=480, min_tokens=480)).encode()
    host, port = server.url.removeprefix("http://").split(":")

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as client:
            before = (await client.get("/rllm_skyrl/v1/stats")).json()["counters"]
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await wait_for_stats(server, lambda s: s["running"] == 1, "the request to start decoding")
        sock.close()
        after = await wait_for_stats(
            server, lambda s: s["running"] == 0 and s["waiting"] == 0, "the abandoned request to leave"
        )
        return before, after["counters"]

    before, after = asyncio.run(run())
    assert after["cancelled"] - before.get("cancelled", 0) == 1
    decoded = after["tokens"] - before.get("tokens", 0)
    assert 1 <= decoded < 480, f"{decoded} tokens were decoded for a request abandoned early"


def test_a_taken_port_is_one_line_naming_it(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is in use .* another --port"):
            InferenceServer(tiny_model_dir, port=port).start()
        command = [sys.executable, "-m", "rllm_skyrl.inference", "--model", str(tiny_model_dir)]
        done = subprocess.run(
            [*command, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is in use by another process: stop that process, or pick "
        "another --port (0 picks a free one)"
    ]
