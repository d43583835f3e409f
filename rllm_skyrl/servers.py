"""Inference servers for rollouts: our CPU servers as subprocesses, or servers someone else runs.

Each CPU server is its own process (``python -m rllm_skyrl.inference``), so generation never
competes with the driver's event loop for the GIL, and a crash in one is a clear error here
rather than a hang. Every server speaks SkyRL's protocol, so the rest of the backend only
ever sees URLs.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rllm_skyrl.run_config import RunConfig

logger = logging.getLogger(__name__)


@dataclass
class ServerGroup:
    """The URLs rollouts go to, and the processes we own behind them (empty for external servers)."""

    urls: list[str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    log_files: list[Path] = field(default_factory=list)

    @property
    def owned(self) -> bool:
        return bool(self.processes)

    def load_weights(self, path: str, weight_version: int, timeout: float = 600.0) -> None:
        """Ask every server to load the full weights the trainer wrote to ``path``."""
        for url in self.urls:
            response = httpx.post(
                f"{url}/rllm_skyrl/v1/load_weights",
                json={"path": path, "weight_version": weight_version},
                timeout=timeout,
            )
            if response.status_code != 200:
                raise RuntimeError(f"weight reload on {url} failed ({response.status_code}): {response.text}")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()


_LISTENING = re.compile(r"listening on (http://\S+)")


def _wait_healthy(process: subprocess.Popen, log_file: Path, timeout: float) -> str:
    """The server prints its URL once bound (it picks a free port); then poll /health."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = log_file.read_text(errors="replace") if log_file.exists() else ""
        if process.poll() is not None:
            raise RuntimeError(
                f"inference server exited with code {process.returncode}; log {log_file}:\n{log[-3000:]}"
            )
        if match := _LISTENING.search(log):
            url = match.group(1)
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    process.kill()
    raise TimeoutError(f"inference server did not become healthy within {timeout:.0f} s; see {log_file}")


def start_cpu_servers(
    model_dir: str,
    num_servers: int,
    log_dir: str | Path,
    *,
    max_model_len: int | None = None,
    max_batch_size: int = 256,
    seed: int = 0,
    timeout: float = 120.0,
) -> ServerGroup:
    """Start ``num_servers`` transformers servers on free loopback ports and wait until they serve."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    group = ServerGroup(urls=[])
    try:
        for index in range(num_servers):
            log_file = log_dir / f"server{index}.log"
            command = [
                sys.executable,
                "-m",
                "rllm_skyrl.inference",
                "--model",
                model_dir,
                "--port",
                "0",
                "--max-batch-size",
                str(max_batch_size),
                "--seed",
                str(seed + index),
            ]
            if max_model_len:
                command += ["--max-model-len", str(max_model_len)]
            with open(log_file, "w") as log:
                process = subprocess.Popen(
                    command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                )
            group.processes.append(process)
            group.log_files.append(log_file)
            group.urls.append(_wait_healthy(process, log_file, timeout))
            logger.info("inference server %d serving %s at %s", index, model_dir, group.urls[-1])
    except BaseException:
        group.stop()
        raise
    return group


def external_servers(urls: list[str]) -> ServerGroup:
    """Servers started elsewhere (SkyRL's vLLM servers, or ours on other machines)."""
    if not urls:
        raise ValueError("inference.urls is empty; give at least one server URL or set it to null")
    for url in urls:
        try:
            httpx.get(f"{url}/health", timeout=5).raise_for_status()
        except httpx.HTTPError as error:
            raise RuntimeError(
                f"inference server {url} is not reachable ({error}); check inference.urls"
            ) from error
    return ServerGroup(urls=list(urls))


@dataclass
class SkyRLServers(ServerGroup):
    """SkyRL's own vLLM servers and router (GPU), with the client SkyRL built for them."""

    client: object = None
    setup: object = None

    def stop(self) -> None:
        for group in getattr(self.setup, "server_groups", []):
            group.shutdown()
        if getattr(self.setup, "router", None) is not None:
            self.setup.router.shutdown()


def start_skyrl_servers(skyrl_cfg, tokenizer, placement_group=None) -> SkyRLServers:
    """vLLM servers exactly as SkyRL's trainer starts them (``generator.inference_engine.*``);
    ``placement_group`` is the one shared with the trainer when ``colocate_all`` is on."""
    from rllm_skyrl.optional_deps import require

    require("vllm")
    from skyrl.backends.skyrl_train.inference_servers.setup import build_new_inference_client

    client, setup = build_new_inference_client(skyrl_cfg, tokenizer, placement_group=placement_group)
    return SkyRLServers(urls=list(setup.server_urls), client=client, setup=setup)


def start_servers(run: RunConfig, tokenizer, placement_group=None) -> ServerGroup:
    """The servers ``run.platform`` picks: given URLs, SkyRL's vLLM servers, or our CPU servers."""
    kind = run.platform.server_kind(run.inference.urls)
    if placement_group is not None and kind != "skyrl_vllm":
        raise ValueError(
            f"skyrl.trainer.placement.colocate_all=true needs SkyRL's vLLM servers started by this "
            f"backend on CUDA, but the servers here are {kind!r}; set colocate_all=false"
            + (" or drop inference.urls" if kind == "external" else "")
        )
    if kind == "skyrl_vllm":
        return start_skyrl_servers(run.skyrl, tokenizer, placement_group)
    if kind == "external":
        return external_servers(list(run.inference.urls))
    return start_cpu_servers(
        run.model_path,
        run.inference.num_engines,
        log_dir=run.log_dir / "inference",
        max_model_len=run.inference.max_model_len,
        max_batch_size=run.inference.max_batch_size,
        seed=run.seed,
    )
