"""rLLM's model gateway in front of our CPU server, as an AgentFlow run uses it (no Ray, no trainer).

One server (a subprocess with the run's token, as a run starts it) and one gateway started by rLLM's
``GatewayManager`` with the ``rllm_gateway`` patch set, shared by the module. Checked: the gateway
is a process of its own listening on loopback only, and the server refuses a caller without the
token; a multi-turn chat through a session becomes, through rLLM's own trace-to-step conversion
and our trajectory checks, training rows equal token for token to what the server saw and sampled,
logprobs included; the session params are the engine's; every published weight version stamps the
traces after it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import socket

import httpx
import psutil
import pytest
from omegaconf import OmegaConf
from rllm_harness import requires_rllm

from rllm_skyrl import compat
from rllm_skyrl.data.adapter import BatchConfig, trajectory_groups_to_batch
from rllm_skyrl.rollout.engine import SkyRLEngine
from rllm_skyrl.rollout.servers import start_cpu_servers, without_credentials

# The default suite's rLLM is installed without its dependencies; CI's full install has the gateway.
requires_gateway = pytest.mark.skipif(
    importlib.util.find_spec("rllm_model_gateway") is None,
    reason="rLLM's model gateway (rllm-model-gateway) is not installed: scripts/install_rllm.sh installs it",
)
pytestmark = [pytest.mark.slow, requires_rllm, requires_gateway]
MAX_RESPONSE = 6


@pytest.fixture(scope="module")
def served(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    from rllm.gateway.manager import GatewayManager

    compat.apply(["rllm_gateway"])
    servers = start_cpu_servers(tiny_model_dir, 1, tmp_path_factory.mktemp("servers"))
    engine = SkyRLEngine.from_urls(
        servers.urls,
        tiny_tokenizer,
        max_prompt_length=256,
        max_response_length=MAX_RESPONSE,
        train_sampling_params={"temperature": 1.0, "max_tokens": 50},
        val_sampling_params={"temperature": 0.5},
    )
    engine.base_model = servers.model_dir
    config = OmegaConf.create({"rllm": {"gateway": {"port": 0}}, "model": {"name": "tiny"}})
    manager = GatewayManager(config, mode="thread")
    manager.start(engine)
    yield manager, engine, servers
    manager.stop()
    servers.stop()


def _listeners(pid: int) -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid == pid
    ]


def _routable_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            ip = probe.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_nothing_answers_from_outside_without_a_credential(served):
    manager, _, servers = served
    assert manager.host == "127.0.0.1" and manager.gateway_url.startswith("http://127.0.0.1:")
    assert manager._process is not None  # a process of its own, not a thread of the driver
    assert _listeners(manager._process.pid) == [("127.0.0.1", manager.port)]
    ip = _routable_ip()
    if ip is not None:  # the gateway's port on this machine's own address: nobody listens
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{ip}:{manager.port}/health", timeout=3)
    (server,) = servers.processes
    for address in _listeners(server.pid):
        assert address[0] in ("127.0.0.1", "::1"), address
    bare = without_credentials(servers.urls[0])
    refused = httpx.post(
        f"{bare}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    )
    assert refused.status_code == 401


def test_session_params_are_the_engines_in_chat_terms(served):
    manager, engine, _ = served
    train = manager._train_sampling_params
    assert train["temperature"] == 1.0 and train["max_tokens"] == MAX_RESPONSE  # 50 capped
    assert "logprobs" not in train  # a flag the gateway sets; the engine's is a count
    assert manager._val_sampling_params["temperature"] == 0.5
    assert engine.gateway is manager


async def _chat(manager, session: str, turns: list[str]) -> list[dict]:
    """A multi-turn conversation through the session's URL, as a flow holds it (assistant turns as
    the text the server returned)."""
    manager._async_client = None  # its HTTP client belongs to the loop that made it: one per test
    await manager.acreate_session(session)
    url = manager.get_session_url(session)
    messages: list[dict] = []
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer EMPTY"}) as client:
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            response = await client.post("/chat/completions", json={"model": "tiny", "messages": messages})
            response.raise_for_status()
            messages.append(
                {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}
            )
    return await manager.aget_traces(session)


def test_multi_turn_training_rows_are_what_the_server_saw_and_sampled(served, tiny_tokenizer):
    from rllm.engine.agentflow_engine import enrich_episode_with_traces
    from rllm.types import Episode, Trajectory, TrajectoryGroup

    manager, _, _ = served
    traces = asyncio.run(_chat(manager, "multi:0", ["what is 3?", "and 4?", "and 5?"]))
    assert len(traces) == 3
    for trace in traces:
        assert trace.prompt_token_ids and trace.completion_token_ids
        assert len(trace.logprobs) == len(trace.completion_token_ids) <= MAX_RESPONSE
    episode = Episode(trajectories=[Trajectory(name="chat", steps=[])])
    enriched = enrich_episode_with_traces(episode, traces, "multi:0", {"question": "what is 3?"})
    (trajectory,) = enriched.trajectories
    trajectory.reward = 1.0
    batch, stats = trajectory_groups_to_batch(
        [TrajectoryGroup(trajectories=[trajectory], group_id="multi")],
        BatchConfig(pad_token_id=tiny_tokenizer.pad_token_id, dp_size=1, max_seq_len=1024),
    )
    assert stats.metrics()["batch/dropped_malformed_sequences"] == 0
    rows = _rows(batch)
    expected = _expected_rows(traces)
    assert rows == expected
    assert len(expected) >= 1


def _rows(batch) -> list[tuple[list[int], list[int], list[float]]]:
    """Each row's tokens, its trained tokens and their rollout logprobs, padding dropped."""
    out = []
    for i in range(len(batch["sequences"])):
        attention = batch["attention_mask"][i].bool()
        tokens = batch["sequences"][i][attention].tolist()
        width = batch["loss_mask"].shape[1]
        window = batch["sequences"][i][-width:]
        trained = batch["loss_mask"][i].bool()
        out.append(
            (
                tokens,
                window[trained].tolist(),
                [round(v, 5) for v in batch["rollout_logprobs"][i][trained].tolist()],
            )
        )
    return out


def _expected_rows(traces) -> list[tuple[list[int], list[int], list[float]]]:
    """Rows built from the traces alone: a turn whose prompt starts with the row so far extends it."""
    rows: list[tuple[list[int], list[int], list[float]]] = []
    for trace in traces:
        prompt, completion = list(trace.prompt_token_ids), list(trace.completion_token_ids)
        logprobs = [round(v, 5) for v in trace.logprobs]
        if rows and prompt[: len(rows[-1][0])] == rows[-1][0]:
            tokens, trained, lps = rows[-1]
            rows[-1] = (prompt + completion, trained + completion, lps + logprobs)
        else:
            rows.append((prompt + completion, completion, logprobs))
    return rows


def test_every_published_weight_version_stamps_the_traces_after_it(served):
    manager, engine, _ = served

    async def two_versions() -> list[int | None]:
        versions = []
        for version in (3, 4):
            await engine.publish_weight_version(version)
            (trace,) = await _chat(manager, f"version:{version}", ["what is 1?"])
            versions.append(trace.weight_version)
        return versions

    assert asyncio.run(two_versions()) == [3, 4]
    assert engine.weight_version == 4
