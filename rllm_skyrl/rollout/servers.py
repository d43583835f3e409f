"""Inference servers for rollouts: our CPU servers as subprocesses, or servers someone else runs.

Each CPU server is its own process (``python -m rllm_skyrl.inference``): generation never competes
with the driver's event loop for the GIL, and a crash is a clear error rather than a hang. Every
server speaks SkyRL's protocol, so the rest of the backend only sees URLs.

Servers we start are locked to the run that started them:

- a random per-run token in the child's environment (``RLLM_SKYRL_SERVER_TOKEN``, readable only by
  our user; never on the command line, which ``ps`` shows to everyone), masked in our logs.
  ``ServerGroup.urls`` carry it as URL credentials: SkyRL's ``RemoteInferenceClient`` has no auth
  option, but its aiohttp sends them as ``Authorization: Basic``; our own calls send ``Bearer``.
- weights are loaded only from under ``weights_root``;
- the child gets our environment minus anything that looks like a credential;
- the child exits when we do (``--parent-pid``), even if ``stop()`` is never called.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from rllm_skyrl.compat import output_masking
from rllm_skyrl.inference.middleware import TOKEN_ENV
from rllm_skyrl.run_config import RunConfig
from rllm_skyrl.secret_masking import is_secret_key

logger = logging.getLogger(__name__)

URL_USER = "rllm"


@dataclass
class ServerGroup:
    """The URLs rollouts go to (with credentials when we hold a ``token``), and the processes we own
    behind them; ``weights_root``, where the servers load weights from, goes on ``stop()`` if ours."""

    urls: list[str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    log_files: list[Path] = field(default_factory=list)
    token: str | None = field(default=None, repr=False)
    weights_root: Path | None = None
    owns_weights_root: bool = False
    model_dir: str | None = None
    # One connection pool for the weight reloads: a new client per call builds a TLS context
    # every step (bench/README.md: 'A step').
    _http: httpx.Client = field(default_factory=httpx.Client, init=False, repr=False)

    @property
    def owned(self) -> bool:
        return bool(self.processes)

    def request_target(self, url: str) -> tuple[str, dict[str, str]]:
        """Where our own HTTP calls go, with which headers: our token as Bearer; a URL given to us
        with credentials keeps them (httpx sends them as Basic)."""
        if self.token is None:
            return url, {}
        return without_credentials(url), {"Authorization": f"Bearer {self.token}"}

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until every launched server serves, and record its URL (with our credentials)."""
        try:
            for index, (process, log_file) in enumerate(zip(self.processes, self.log_files, strict=True)):
                url = _wait_healthy(process, log_file, timeout)
                self.urls.append(with_credentials(url, self.token) if self.token else url)
                logger.info("inference server %d serving %s at %s", index, self.model_dir, url)
        except BaseException:
            self.stop()
            raise

    def check_alive(self) -> None:
        """Raise when a server we started has died: rollouts would otherwise fail one by one and the
        run would train on nothing."""
        for index, (process, log) in enumerate(zip(self.processes, self.log_files, strict=True)):
            code = process.poll()
            if code is not None:
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                raise RuntimeError(
                    f"inference server {index} (pid {process.pid}) exited with code {code}; "
                    f"log {log}:\n{tail}"
                )

    def load_weights(self, path: str, weight_version: int, timeout: float = 600.0) -> None:
        self.check_alive()
        for url in self.urls:
            target, headers = self.request_target(url)
            response = self._http.post(
                f"{target}/rllm_skyrl/v1/load_weights",
                json={"path": path, "weight_version": weight_version},
                headers=headers,
                timeout=timeout,
            )
            if response.status_code != 200:
                raise RuntimeError(
                    f"weight reload on {without_credentials(url)} failed ({response.status_code}): "
                    f"{response.text}"
                )

    def stop(self) -> None:
        self._http.close()
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
        if self.owns_weights_root and self.weights_root is not None:
            shutil.rmtree(self.weights_root, ignore_errors=True)
            self.owns_weights_root = False


def without_credentials(url: str) -> str:
    """``url`` minus any ``user:password@`` part (for logs and for calls that send a header)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=host))


def with_credentials(url: str, token: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{URL_USER}:{token}@{parts.netloc}"))


# Beyond is_secret_key's words: name words that mark a credential, and values that are one.
_CREDENTIAL_WORDS = {"auth", "pat", "pass", "passphrase", "cookie", "bearer", "jwt", "dsn", "private"}
_CREDENTIAL_VALUE = re.compile(
    r"://[^/\s:@]+:[^/\s@]+@"  # a URL with a password
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
    r"|\b(?:gh[pousr]_|github_pat_|glpat-|hf_|sk-|xox[abprs]-)[A-Za-z0-9_\-]{16,}"
    r"|\bAKIA[0-9A-Z]{16}\b"
    r"|\beyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\."  # a JWT
)


def looks_like_credential(name: str, value: str) -> bool:
    """Whether an environment variable holds a secret: a secret-looking name (``HF_TOKEN``,
    ``DB_PASS``, ``SSH_AUTH_SOCK``) or a secret-looking value (a URL with a password, a key)."""
    words = set(re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()))
    return is_secret_key(name) or bool(words & _CREDENTIAL_WORDS) or bool(_CREDENTIAL_VALUE.search(value))


def server_environment(environ: Mapping[str, str], token: str) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if not looks_like_credential(k, v)}
    return {**env, "TOKENIZERS_PARALLELISM": "false", TOKEN_ENV: token}


_LISTENING = re.compile(r"listening on (http://\S+)")


def _wait_healthy(process: subprocess.Popen, log_file: Path, timeout: float) -> str:
    """The server prints its URL once bound (it picks a free port); then poll /health (open)."""
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


def start_cpu_servers(model_dir: str, num_servers: int, log_dir: str | Path, **options: Any) -> ServerGroup:
    """``launch_cpu_servers`` (same options), then wait until every server serves."""
    group = launch_cpu_servers(model_dir, num_servers, log_dir, **options)
    group.wait_ready()
    return group


def launch_cpu_servers(
    model_dir: str,
    num_servers: int,
    log_dir: str | Path,
    *,
    weights_root: str | Path | None = None,
    max_model_len: int | None = None,
    max_batch_size: int = 256,
    seed: int = 0,
    threads: int = 1,
) -> ServerGroup:
    """Start the server processes and return at once; ``wait_ready`` waits until they serve.

    ``weights_root`` (a run's ``<checkpoint root>/sync``) is the only place the servers load weights
    from; None makes a private temporary directory, removed by ``stop()``.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    output_masking.mask([token])
    owns_root = weights_root is None
    root = Path(tempfile.mkdtemp(prefix="rllm-skyrl-weights-")) if owns_root else Path(weights_root)
    group = ServerGroup(
        urls=[], token=token, weights_root=root, owns_weights_root=owns_root, model_dir=model_dir
    )
    env = server_environment(os.environ, token)
    command = [sys.executable, "-m", "rllm_skyrl.inference", "--model", model_dir, "--port", "0"]
    command += ["--weights-root", str(root), "--max-batch-size", str(max_batch_size)]
    command += ["--threads", str(threads), "--parent-pid", str(os.getpid())]
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    try:
        for index in range(num_servers):
            log_file = log_dir / f"server{index}.log"
            with open(log_file, "w") as log:
                process = subprocess.Popen(
                    [*command, "--seed", str(seed + index)], stdout=log, stderr=subprocess.STDOUT, env=env
                )
            group.processes.append(process)
            group.log_files.append(log_file)
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
    """SkyRL's vLLM servers and router (GPU) with SkyRL's client for them, and with ``colocate_all``
    the placement group shared with the trainer's actors (the runtime removes it after those)."""

    client: object = None
    setup: object = None
    placement_group: object = None

    def stop(self) -> None:
        for group in getattr(self.setup, "server_groups", []):
            group.shutdown()
        if getattr(self.setup, "router", None) is not None:
            self.setup.router.shutdown()


def start_skyrl_servers(skyrl_cfg, tokenizer) -> SkyRLServers:
    """vLLM servers as SkyRL's trainer starts them: with ``colocate_all``, after the placement group
    shared with the trainer (SkyRL's order: they size their memory while the trainer is not on the GPUs)."""
    from rllm_skyrl.optional_deps import require

    require("vllm")
    from skyrl.backends.skyrl_train.inference_servers.setup import build_new_inference_client

    placement_group = (
        colocated_placement_group(skyrl_cfg) if skyrl_cfg.trainer.placement.colocate_all else None
    )
    client, setup = build_new_inference_client(skyrl_cfg, tokenizer, placement_group=placement_group)
    return SkyRLServers(
        urls=list(setup.server_urls), client=client, setup=setup, placement_group=placement_group
    )


def start_servers(run: RunConfig, tokenizer) -> ServerGroup:
    """The servers ``run.platform`` picks: given URLs, SkyRL's vLLM servers, or our CPU servers
    (launched; the caller waits with ``wait_ready``, so other bring-up overlaps their start)."""
    kind = run.platform.server_kind(run.inference.urls)
    if run.skyrl.trainer.placement.colocate_all and kind != "skyrl_vllm":
        raise ValueError(
            f"skyrl.trainer.placement.colocate_all=true needs SkyRL's vLLM servers started by this "
            f"backend on CUDA, but the servers here are {kind!r}; set colocate_all=false"
            + (" or drop inference.urls" if kind == "external" else "")
        )
    if kind == "skyrl_vllm":
        return start_skyrl_servers(run.skyrl, tokenizer)
    if kind == "external":
        return external_servers(list(run.inference.urls))
    return launch_cpu_servers(
        run.model_path,
        run.inference.num_engines,
        log_dir=run.log_dir / "inference",
        weights_root=run.sync_dir,
        max_model_len=run.inference.max_model_len,
        max_batch_size=run.inference.max_batch_size,
        seed=run.seed,
        threads=run.inference.threads,
    )


def colocated_placement_group(skyrl_cfg: Any):
    """SkyRL's ``colocate_all`` placement: one ``{GPU: 1, CPU: 1}`` bundle per inference GPU, which
    the vLLM servers and the trainer's actors then share (as SkyRL's ``BasePPOExp.get_colocate_pg``)."""
    from ray.util.placement_group import placement_group
    from skyrl.env_vars import SKYRL_RAY_PG_TIMEOUT_IN_S
    from skyrl.train.utils.utils import ResolvedPlacementGroup, get_ray_pg_ready_with_timeout

    engines = skyrl_cfg.generator.inference_engine
    slots = (
        engines.num_engines
        * engines.tensor_parallel_size
        * engines.pipeline_parallel_size
        * engines.data_parallel_size
    )
    pg = placement_group([{"GPU": 1, "CPU": 1}] * slots, strategy="PACK")
    get_ray_pg_ready_with_timeout(pg, timeout=SKYRL_RAY_PG_TIMEOUT_IN_S)
    return ResolvedPlacementGroup(pg)
