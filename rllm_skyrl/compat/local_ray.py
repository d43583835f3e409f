"""The ``local_ray`` set: a CPU run's local Ray, the head node's daemons a run uses, in a process of its own.

Built on Ray's private classes and settings, so the set applies only on CPU, on the Ray it was
verified on, without an NVIDIA driver or a cluster to join; elsewhere ``ray_cluster.start_ray``
calls ``ray.init`` with public arguments only.

``ray.init`` starts, and waits for, the dashboard head (even with ``include_dashboard=False``,
which only trims its modules), the autoscaler monitor (nothing to scale) and the log monitor (our
drivers connect with ``log_to_driver=False``; the logs stay in the session's files). On two cores
those cost core-seconds and held up the start by their imports (bench/README.md: 'Start-up'); the
dashboard head and the monitor also served Prometheus metrics without authentication on every
interface. Here the head ``Node`` gets the resources ``ray.init`` would give it and
``SYSTEM_CONFIG``, but none of those three, and a dashboard agent in Ray's minimal mode (no HTTP or
metrics servers): the GCS, the raylet and its two agents are what actors, placement groups and
runtime envs need. Launched at a run's first line (``training_run.train``), beside the driver's
imports, it is up before the driver first asks.

The process stops Ray when ``stop`` asks, or within half a second of the driver's end however it
ends: it polls its parent, which survives a SIGKILL where a parent-death signal would be tied to
the thread that forked it. Ctrl-C is the driver's to act on, not this process's.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PARENT_POLL_SECONDS = 0.5
STOP_SECONDS = 30.0

# Ray's private settings for a CPU run's head. No worker prestarted for the first driver: it would
# carry no runtime env, so each actor gets a new process anyway and the prestarted one imports for
# nothing. Workers at the driver's priority, not niceness 15: the training worker shares the cores
# with the CPU inference server, and every wake-up of another process pre-empted one of its OpenMP
# threads while the others waited at the next barrier (bench/README.md: 'A step').
SYSTEM_CONFIG: dict[str, Any] = {"prestart_worker_first_driver": False, "worker_niceness": 0}


def token_env(token: str) -> dict[str, str]:
    """What makes a local Ray refuse every client without ``token``: Ray 2.57's gRPC servers and
    agents listen on every interface, with no setting to bind them to loopback. Without metrics
    collection the raylet's Prometheus exporter is not started either.
    """
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_enable_metrics_collection": "0"}


def require_token(token: str | None = None) -> str:
    """This process's Ray clients and the Ray it starts use ``token`` (a new one by default).

    Ray reads these settings when it is imported, hence the re-read. Workers inherit the token from
    the raylet.
    """
    import ray

    token = token or secrets.token_urlsafe(32)
    os.environ.update(token_env(token))
    ray._raylet.Config.initialize("")
    ray._raylet.AuthenticationTokenLoader.instance().reset_cache()
    return token


@dataclass
class LocalRay:
    process: subprocess.Popen
    token: str = field(repr=False)
    init_args: dict[str, Any]
    log_file: Path
    _address: str | None = None

    def address(self, timeout: float = 120.0) -> str:
        """Ray's address, once it is up (the process prints it then)."""
        if self._address is None:
            line: list[str] = []
            reader = threading.Thread(target=lambda: line.append(self.process.stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout)
            if not line or not line[0].strip():
                self.stop()
                log = self.log_file.read_text(errors="replace")[-3000:] if self.log_file.exists() else ""
                raise RuntimeError(f"the run's Ray did not start (log {self.log_file}):\n{log}")
            self._address = line[0].strip()
        return self._address

    def stop(self) -> None:
        """Stop Ray and the process; its log goes too once it has exited cleanly."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.returncode == 0:
            shutil.rmtree(self.log_file.parent, ignore_errors=True)


_launched: LocalRay | None = None


def launch(init_args: dict[str, Any]) -> LocalRay:
    """Start this run's local Ray in its own process with ``init_args`` for ``ray.init``."""
    global _launched
    token = secrets.token_urlsafe(32)
    log_file = Path(tempfile.mkdtemp(prefix="rllm_skyrl_ray_")) / "ray.log"
    env = {
        **os.environ,
        **token_env(token),
        "RAY_BACKEND_LOG_LEVEL": os.environ.get("RAY_BACKEND_LOG_LEVEL", "fatal"),
    }
    with open(log_file, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(init_args), str(os.getpid())],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            text=True,
            start_new_session=True,  # a Ctrl-C at the terminal is the driver's, which then stops it
        )
    _launched = LocalRay(process, token, init_args, log_file)
    return _launched


def apply(platform: Any, num_cpus: int | None, runtime_env: dict[str, Any]) -> None:
    """Connect this process to the run's own Ray: the one launched at the run's first line if it
    has what ``platform`` asks for (else that one is stopped), or one launched now."""
    import ray

    init_args = platform.ray_init_args(num_cpus)
    local = launched()
    if local is not None and local.init_args != init_args:
        logger.info("the Ray launched at start-up is not the one this run needs; starting another")
        stop()
        local = None
    local = local or launch(init_args)
    require_token(local.token)
    address = local.address()
    ray.init(address=address, _node_ip_address="127.0.0.1", runtime_env=runtime_env, log_to_driver=False)


def wanted() -> bool:
    """Whether a run here gets this Ray: no Ray up or named (``RAY_ADDRESS``), no NVIDIA driver
    (so the platform is CPU, known without importing torch), and the set usable on this Ray.
    Asks Ray only if this process imported it (importing it to ask takes half a second or more)."""
    from rllm_skyrl import compat
    from rllm_skyrl.hardware import has_nvidia_driver

    ray = sys.modules.get("ray")
    connected = ray is not None and ray.is_initialized()
    if connected or os.environ.get("RAY_ADDRESS") or has_nvidia_driver():
        return False
    return bool(compat.usable(["local_ray"]))


def launch_for_cpu_run() -> LocalRay | None:
    """At a run's first line: this machine's Ray in its own process, where the run will want it."""
    if _launched is not None or not wanted():
        return None
    from rllm_skyrl.hardware import Platform

    return launch(Platform(cuda=False).ray_init_args())


def launched() -> LocalRay | None:
    """The local Ray this process launched, while it runs."""
    return _launched if _launched is not None and _launched.process.poll() is None else None


def stop(local: LocalRay | None = None) -> None:
    """Stop ``local``, by default the local Ray this process launched, if any (after ``ray.shutdown``)."""
    global _launched
    local = local or _launched
    if local is _launched:
        _launched = None
    if local is not None:
        local.stop()


def start_head(init_args: dict[str, Any]):
    """Ray's head ``Node`` as ``ray.init(**init_args)`` starts it, minus the daemons listed above.

    The dashboard head has no setting, so this node's ``start_api_server`` starts nothing; the
    agent's minimal mode is Ray's choice where its dashboard dependencies are missing, made here on
    purpose.
    """
    from ray._common.usage import usage_lib
    from ray._private import services
    from ray._private import utils as ray_utils
    from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    class HeadNode(Node):
        def start_api_server(self, *, include_dashboard, raise_on_failure) -> None:
            """No dashboard head: nothing of a run's asks it anything."""

    args = dict(init_args)
    args.pop("include_dashboard", None)
    system_config = dict(SYSTEM_CONFIG)
    ensure_token_if_auth_enabled(system_config, create_token_if_missing=False)
    usage_lib.set_usage_stats_enabled_via_env_var(False)  # as ray.init does
    ray_utils.get_dashboard_dependency_error = lambda: ImportError("minimal dashboard agent")
    params = RayParams(
        node_ip_address=services.resolve_ip_for_localhost("127.0.0.1"),
        include_dashboard=False,
        no_monitor=True,
        include_log_monitor=False,
        _system_config=system_config,
        **args,
    )
    return HeadNode(params, head=True, shutdown_at_exit=False, spawn_reaper=True, ray_init_cluster=True)


def main() -> None:
    """``python -m rllm_skyrl.compat.local_ray INIT_ARGS_JSON PARENT_PID``: run Ray until told or orphaned."""
    init_args, parent = json.loads(sys.argv[1]), int(sys.argv[2])
    stopping = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    node = start_head(init_args)
    print(node.gcs_address, flush=True)
    try:
        while not stopping.wait(PARENT_POLL_SECONDS) and os.getppid() == parent:
            pass
    finally:
        node.destroy_external_storage()
        node.kill_all_processes(check_alive=False, allow_graceful=True)


if __name__ == "__main__":
    main()
