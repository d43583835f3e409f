"""Where an AgentFlow rollout step's time goes: the digit task's 16 x 32 flows through rLLM's model gateway.

No training, no Ray: one CPU inference server in a subprocess (as in training), rLLM's model gateway
as the backend starts it (``compat.rllm_gateway``), and rLLM's ``AgentFlowEngine`` running
``examples/simple_math/flow.py`` on ``--prompts`` x ``--samples`` tasks per step. Per step it prints
the wall time, the CPU seconds of this process (flows, rLLM's engine, the gateway when it runs in a
thread) and of the server, the server's prefills and decode steps, and the mean per-rollout phases
rLLM records (session + flow, trace fetch, evaluator, hooks). The same requests are also timed
without the gateway (the flow's client straight at the server's OpenAI route) and as the workflow
path sends them (``SkyRLEngine.get_model_response``: a prompt's samples in one request), so each hop
has its own figure. Settings alternate per step, so load changes hit every side alike.

    python -m bench.gateway_breakdown [--steps 3] [--parallel 512] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

Phases = dict[str, float]
PHASES = ("setup", "agentflow", "agentflow_llm_sum", "traces", "evaluator", "teardown", "rollout")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps per side")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--parallel", type=int, nargs="+", default=[512], help="n_parallel_tasks to compare")
    parser.add_argument("--sides", nargs="+", default=["gateway", "direct", "workflow"])
    parser.add_argument("--gateway", nargs="+", default=["process", "thread"], help="where the gateway runs")
    parser.add_argument("--profile", default=None, help="cProfile the gateway steps of this process here")
    return parser.parse_args()


class Rig:
    """The server, the engine over it, and rLLM's gateway in front, started as the backend starts them."""

    def __init__(self, tmp: Path, max_batch_size: int, modes: list[str]):
        from omegaconf import OmegaConf
        from rllm.gateway.manager import GatewayManager
        from transformers import AutoTokenizer

        from rllm_skyrl import compat
        from rllm_skyrl.compat import rllm_gateway
        from rllm_skyrl.rollout.engine import SkyRLEngine
        from rllm_skyrl.rollout.servers import start_cpu_servers
        from rllm_skyrl.tiny_model import build_tiny_model

        compat.apply(["rllm_gateway"])
        model_dir = str(build_tiny_model())
        self.servers = start_cpu_servers(model_dir, 1, tmp / "logs", max_batch_size=max_batch_size)
        self.server_process = psutil.Process(self.servers.processes[0].pid)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.engine = SkyRLEngine.from_urls(
            self.servers.urls,
            tokenizer,
            max_prompt_length=64,
            max_response_length=2,
            train_sampling_params={"temperature": 1.0, "top_p": 1.0},
            base_model=model_dir,
        )
        config = OmegaConf.create({"rllm": {"gateway": {"port": 0}}, "model": {"name": model_dir}})
        self.gateways = {}
        for mode in modes:  # rLLM's thread mode, or the process of its own the backend starts
            rllm_gateway.SEPARATE_PROCESS = mode == "process"
            self.gateways[mode] = GatewayManager(config)
            self.gateways[mode].start(self.engine)
        self.model = self.engine.served_model

    def gateway_cpu(self, mode: str) -> float:
        gateway = self.gateways.get(mode)
        process = gateway._process if gateway is not None else None
        return sum(psutil.Process(process.pid).cpu_times()[:2]) if process is not None else 0.0

    def stats(self) -> dict[str, int]:
        from rllm_skyrl.rollout.servers import without_credentials

        url = without_credentials(self.servers.urls[0])
        headers = {"Authorization": f"Bearer {self.servers.token}"}
        return httpx.get(f"{url}/rllm_skyrl/v1/stats", headers=headers).json()["counters"]

    def stop(self) -> None:
        for gateway in self.gateways.values():
            gateway.stop()
        self.servers.stop()


def tasks(prompts: int, samples: int, step: int) -> tuple[list[dict], list[str]]:
    from examples.simple_math.task import make_rows

    rows = make_rows(prompts, seed=step)
    return [r for r in rows for _ in range(samples)], [r["id"] for r in rows for _ in range(samples)]


async def gateway_step(rig: Rig, mode: str, parallel: int, rows: list[dict], ids: list[str]) -> Phases:
    from rllm.engine.agentflow_engine import AgentFlowEngine

    from examples.simple_math.flow import digit_evaluator, digit_flow

    engine = AgentFlowEngine(
        agent_flow=digit_flow,
        evaluator=digit_evaluator,
        gateway=rig.gateways[mode],
        model=rig.model,
        n_parallel_tasks=parallel,
        train_sampling_params=rig.engine.gateway_session_params(False, None),
    )
    try:
        episodes = await engine.execute_tasks(rows, ids)
    finally:
        engine.executor.shutdown(wait=False)
    return {p: statistics.fmean(e.metrics.get(f"time/{p}_s", 0.0) for e in episodes) for p in PHASES}


async def direct_step(rig: Rig, mode: str, parallel: int, rows: list[dict], ids: list[str]) -> Phases:
    """The flow's call, with what the gateway adds to it (the session's params, logprobs and token ids),
    straight at the server's chat route: no gateway, no sessions, no traces."""
    from openai import AsyncOpenAI

    base = rig.servers.urls[0] + "/v1"  # its credentials go as Basic auth, as the gateway sends them
    extra = {**rig.engine.gateway_session_params(False, None), "logprobs": True, "return_token_ids": True}
    # One timeout for connecting too (OpenAI's own is 5 s): 512 connections at once to a busy server.
    client = AsyncOpenAI(base_url=base, api_key="EMPTY", max_retries=0, timeout=600.0)
    gate = asyncio.Semaphore(parallel)

    async def one(row: dict) -> None:
        async with gate:
            messages = [{"role": "user", "content": row["question"]}]
            await client.chat.completions.create(model=rig.model, messages=messages, extra_body=extra)

    try:
        await asyncio.gather(*(one(r) for r in rows))
    finally:
        await client.close()
    return {}


async def workflow_step(rig: Rig, mode: str, parallel: int, rows: list[dict], ids: list[str]) -> Phases:
    """As rLLM's workflows sample on this backend: ``get_model_response`` per rollout (the engine sends
    a prompt's concurrent samples as one request)."""
    gate = asyncio.Semaphore(parallel)

    async def one(row: dict) -> None:
        async with gate:
            await rig.engine.get_model_response([{"role": "user", "content": row["question"]}])

    await asyncio.gather(*(one(r) for r in rows))
    return {}


SIDES: dict[str, Callable[..., Awaitable[Phases]]] = {
    "gateway": gateway_step,
    "direct": direct_step,
    "workflow": workflow_step,
}


async def measure(rig: Rig, side: str, mode: str, parallel: int, step: int, args, profiler) -> dict[str, Any]:
    rows, ids = tasks(args.prompts, args.samples, step)
    before, server_cpu = rig.stats(), sum(rig.server_process.cpu_times()[:2])
    gateway_cpu = rig.gateway_cpu(mode)
    cpu, load, start = time.process_time(), os.getloadavg()[0], time.perf_counter()
    if profiler is not None and side == "gateway":
        profiler.enable()
    phases = await SIDES[side](rig, mode, parallel, rows, ids)
    if profiler is not None:
        profiler.disable()
    wall = time.perf_counter() - start
    after = rig.stats()
    return {
        "wall": wall,
        "cpu": time.process_time() - cpu,
        "server_cpu": sum(rig.server_process.cpu_times()[:2]) - server_cpu,
        "gateway_cpu": rig.gateway_cpu(mode) - gateway_cpu,
        "prefills": after["prefills"] - before["prefills"],
        "decodes": after["decode_steps"] - before["decode_steps"],
        "load": load,
        **phases,
    }


async def run(args: argparse.Namespace, rig: Rig) -> None:
    profiler = cProfile.Profile() if args.profile else None
    combos = [("gateway", mode, p) for mode in args.gateway for p in args.parallel if "gateway" in args.sides]
    combos += [(side, "-", args.parallel[0]) for side in args.sides if side != "gateway"]
    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {c: [] for c in combos}
    for combo in combos:  # warm-up: connections, render cache, thread pools
        print("warm-up", combo, await measure(rig, *combo, step=0, args=args, profiler=None), flush=True)
    for step in range(1, args.steps + 1):
        for combo in combos:
            results[combo].append(await measure(rig, *combo, step=step, args=args, profiler=profiler))
            print(combo, {k: round(v, 3) for k, v in results[combo][-1].items()}, flush=True)
    for (side, mode, parallel), rows in results.items():
        mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
        wall = statistics.median(r["wall"] for r in rows)
        line = (
            f"{side:8s} {mode:7s} parallel {parallel:4d}: step {wall:6.2f} s (median of {len(rows)}), driver "
            f"cpu {mean['cpu']:5.2f} s, gateway process cpu {mean['gateway_cpu']:5.2f} s, server cpu "
            f"{mean['server_cpu']:5.2f} s, {mean['prefills']:.0f} prefills, "
            f"{mean['decodes']:.0f} decode steps, load {mean['load']:.1f}"
        )
        if side == "gateway":
            line += "\n    per rollout (mean s): " + ", ".join(f"{p} {mean[p]:.3f}" for p in PHASES)
        print(line, flush=True)
    if profiler is not None:
        profiler.dump_stats(args.profile)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="gateway_breakdown_") as tmp:
        rig = Rig(Path(tmp), max(512, args.prompts * args.samples), args.gateway)
        try:
            asyncio.run(run(args, rig))
        finally:
            rig.stop()


if __name__ == "__main__":
    main()
