"""rLLM's model gateway in front of SkyRL's inference servers, reachable from this machine only.

rLLM's ``GatewayManager.start`` chooses how to reach the inference servers by the rollout engine's
class name (Tinker's in-process handler, verl's server addresses) and registers no worker for any
other engine; it also listens on every interface, without a credential. ``start`` is wrapped: for
an engine that is neither of those two and lists its servers (``server_addresses``), the gateway
listens on 127.0.0.1 only, and every server becomes a worker. It runs in a process of its own
(rLLM's ``process`` mode, which rLLM's trainer picks only for verl): in a thread of the driver, its
HTTP work (four requests per rollout: session, chat, flush, traces) takes the GIL from the flows and
rLLM's engine, and a step's rollouts are that CPU. A server's URL
carries the run's token as user info, which the gateway's HTTP client sends as Basic auth in place
of the flow's ``Authorization`` header. The model the gateway pins and the sampling params under
every session come from the engine (``gateway_session_params``). Any other engine gets rLLM's own start.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

MODULE = "rllm.gateway.manager"
LOOPBACK = "127.0.0.1"
RLLM_ENGINES = frozenset({"TinkerEngine", "VerlEngine"})  # the engines rLLM's start serves itself
START_TIMEOUT = 60.0  # the process imports FastAPI and pydantic first: seconds on a busy machine
SEPARATE_PROCESS = True  # False: a thread of the driver, as rLLM's thread mode (bench/gateway_breakdown.py)
_ORIGINAL = "__rllm_skyrl_original__"
_ENGINE = "_rllm_skyrl_engine"
Params = dict[str, Any] | None


def serves(engine: Any) -> bool:
    return type(engine).__name__ not in RLLM_ENGINES and hasattr(engine, "server_addresses")


def apply() -> None:
    from rllm.gateway.manager import GatewayManager

    if hasattr(GatewayManager.start, _ORIGINAL):
        return
    original_start = GatewayManager.start
    original_create = GatewayManager.create_session
    original_acreate = GatewayManager.acreate_session

    @functools.wraps(original_start)
    def start(self: Any, rollout_engine: Any) -> None:
        if not serves(rollout_engine):
            original_start(self, rollout_engine)
            return
        start_for_engine(self, rollout_engine)

    @functools.wraps(original_create)
    def create_session(
        self: Any, session_id: str, is_validation: bool = False, sampling_params: Params = None
    ) -> str:
        params = _session_params(self, is_validation, sampling_params)
        return original_create(self, session_id, is_validation=is_validation, sampling_params=params)

    @functools.wraps(original_acreate)
    async def acreate_session(
        self: Any, session_id: str, is_validation: bool = False, sampling_params: Params = None
    ) -> str:
        params = _session_params(self, is_validation, sampling_params)
        return await original_acreate(self, session_id, is_validation=is_validation, sampling_params=params)

    setattr(start, _ORIGINAL, original_start)
    GatewayManager.start = start
    GatewayManager.create_session = create_session
    GatewayManager.acreate_session = acreate_session


def _session_params(manager: Any, is_validation: bool, given: dict[str, Any] | None) -> dict[str, Any] | None:
    """The engine's params under the ones the caller gives (rLLM passes ``rllm.rollout.train``/``val``),
    ``max_tokens`` capped at the run's response length; for any other engine, the caller's."""
    engine = getattr(manager, _ENGINE, None)
    if engine is None:
        return given
    return engine.gateway_session_params(is_validation, given)


def start_for_engine(manager: Any, engine: Any) -> None:
    """Serve the gateway on 127.0.0.1 and register the engine's servers as its workers."""
    if manager.tunnel_backend or manager.public_url:
        raise ValueError("rllm.gateway.tunnel is set: this gateway listens on 127.0.0.1 only; set it to null")
    manager.host = LOOPBACK
    manager.port = free_port() if not manager.port else manager.port
    if SEPARATE_PROCESS:
        _spawn(manager, model=engine.served_model)
    else:
        _serve(manager, model=engine.served_model)
    for url in engine.server_addresses:
        worker_id = manager.client.add_worker(url=url)
        logger.info("gateway worker %s registered", worker_id)  # the URL holds the servers' token
    manager._train_sampling_params = engine.gateway_session_params(False, None)
    manager._val_sampling_params = engine.gateway_session_params(True, None)
    setattr(manager, _ENGINE, engine)
    engine.gateway = manager


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


def _spawn(manager: Any, model: str | None) -> None:
    """rLLM's gateway CLI in a child process bound to 127.0.0.1 that exits with the driver;
    ``manager.stop()`` terminates it (rLLM's process mode keeps it in ``manager._process``)."""
    command = [sys.executable, "-m", "rllm_skyrl.compat.rllm_gateway_process", str(os.getpid())]
    command += ["--host", LOOPBACK, "--port", str(manager.port), "--store", manager.store]
    command += ["--log-level", "warning"]
    if model:
        command += ["--model", model]
    if manager.db_path:
        command += ["--db-path", manager.db_path]
    if manager.cumulative_token_mode:
        command.append("--cumulative-token-mode")
        if manager.renderer_family != "auto":
            command += ["--renderer-family", manager.renderer_family]
    manager._process = process = subprocess.Popen(command)
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            manager.client.health()
            break
        except Exception as error:  # not listening yet
            if process.poll() is not None:
                raise RuntimeError(
                    f"rLLM's model gateway exited (code {process.returncode}) before serving on "
                    f"{LOOPBACK}:{manager.port}; see its output above, or set rllm.gateway.port=0 to take a "
                    "free port"
                ) from error
            if time.monotonic() > deadline:
                manager.stop()
                raise TimeoutError(
                    f"rLLM's model gateway did not serve within {START_TIMEOUT:.0f} s"
                ) from error
            time.sleep(0.2)
    logger.info("rLLM's model gateway serves %s (process %d)", manager.gateway_url, process.pid)


def _serve(manager: Any, model: str | None) -> None:
    """rLLM's gateway app under uvicorn in a daemon thread, as rLLM's thread mode runs it, bound to
    127.0.0.1; ``manager.stop()`` stops it."""
    import uvicorn
    from rllm_model_gateway.models import GatewayConfig
    from rllm_model_gateway.server import create_app

    config = GatewayConfig(
        host=LOOPBACK,
        port=manager.port,
        db_path=manager.db_path,
        store_worker=manager.store,
        model=model,
        add_logprobs=manager.add_logprobs,
        add_return_token_ids=manager.add_return_token_ids,
        cumulative_token_mode=manager.cumulative_token_mode,
        renderer_family=manager.renderer_family,
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(config=config), host=LOOPBACK, port=manager.port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="rllm-model-gateway", daemon=True)
    thread.start()
    manager._server, manager._thread = server, thread
    deadline = time.monotonic() + START_TIMEOUT
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(
                f"rLLM's model gateway did not start on {LOOPBACK}:{manager.port} (see the log above); "
                "set rllm.gateway.port=0 to take a free port"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"rLLM's model gateway did not start within {START_TIMEOUT:.0f} s")
        time.sleep(0.05)
    logger.info("rLLM's model gateway serves %s", manager.gateway_url)
