"""A run's local Ray, started in a process of its own at the run's first line.

``ray.init`` starts Ray's daemons and waits 4-5 s for them (the API server, then the raylet and its
two Python agents). Called from ``Runtime.start``, that wait came after the driver had imported
torch and the backend, and meanwhile the second core had nothing to do. ``launch`` starts
``python -m rllm_skyrl.ray_head`` instead, which runs the same local ``ray.init`` (the resources and
system config ``runtime.start_ray`` would give it, and this run's token) and prints Ray's address;
``start_ray`` later connects to it with the run's runtime env. Where the run's platform wants
another Ray than the one launched, ``start_ray`` stops it and starts its own as before.

The process stops Ray when ``stop`` asks it to, or within half a second of the driver's end,
however it ends: it polls its parent, which survives a SIGKILL where a parent-death signal would
be tied to the thread that forked it. It ignores Ctrl-C (and runs in a session of its own, out of
the terminal's reach): stopping on one is the driver's to decide.
"""

from __future__ import annotations

import json
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

PARENT_POLL_SECONDS = 0.5
STOP_SECONDS = 30.0
# The machine has no NVIDIA driver when none of these exist; torch then sees no CUDA device.
NVIDIA_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg")


def token_env(token: str) -> dict[str, str]:
    """What makes a local Ray refuse every client without ``token``.

    Ray 2.57's gRPC servers and agents listen on every interface, with no setting to bind them to
    loopback; with Ray's token authentication they refuse anyone without the token, and the
    raylet's Prometheus exporter is not started. Still open: the dashboard head and the autoscaler
    monitor serve their metrics unauthenticated on ports 44227 and 44217 when those are free.
    """
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_enable_metrics_collection": "0"}


def require_token(token: str | None = None) -> str:
    """This process's Ray clients and the Ray it starts use ``token`` (a new one by default).

    Ray reads these settings once, when it is imported, hence the re-read. Workers inherit the
    token from the raylet.
    """
    import ray

    token = token or secrets.token_urlsafe(32)
    os.environ.update(token_env(token))
    ray._raylet.Config.initialize("")
    ray._raylet.AuthenticationTokenLoader.instance().reset_cache()
    return token


@dataclass
class LocalRay:
    """The process running a run's local Ray, and what it was started with."""

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
    log_file = Path(tempfile.mkdtemp(prefix="rllm_skyrl_ray_")) / "ray_head.log"
    env = {
        **os.environ,
        **token_env(token),
        "RAY_BACKEND_LOG_LEVEL": os.environ.get("RAY_BACKEND_LOG_LEVEL", "fatal"),
    }
    with open(log_file, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "rllm_skyrl.ray_head", json.dumps(init_args), str(os.getpid())],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            text=True,
            start_new_session=True,  # a Ctrl-C at the terminal is the driver's, which then stops it
        )
    _launched = LocalRay(process, token, init_args, log_file)
    return _launched


def launch_for_cpu_run() -> LocalRay | None:
    """At a run's first line: this machine's Ray in its own process, where the run will want it.

    Only where no Ray is up or named (``RAY_ADDRESS``), and the machine has no NVIDIA driver, so
    the platform is CPU without asking torch; elsewhere ``start_ray`` starts Ray as before.
    """
    import ray

    if _launched is not None or ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return None
    if any(os.path.exists(path) for path in NVIDIA_DRIVER_PATHS):
        return None
    from rllm_skyrl.platform import Platform

    return launch(local_init_args(Platform(cuda=False)))


def local_init_args(platform, num_cpus: int | None = None) -> dict[str, Any]:
    """The ``ray.init`` arguments of a run's local Ray on ``platform`` (the runtime env aside)."""
    return {
        "include_dashboard": False,
        "_system_config": {"prestart_worker_first_driver": False, **platform.ray_system_config()},
        **platform.ray_resources(num_cpus),
    }


def launched() -> LocalRay | None:
    """The local Ray this process launched, while it runs."""
    return _launched if _launched is not None and _launched.process.poll() is None else None


def stop() -> None:
    """Stop the local Ray this process launched, if any (after ``ray.shutdown``)."""
    global _launched
    local, _launched = _launched, None
    if local is not None:
        local.stop()


def main() -> None:
    """``python -m rllm_skyrl.ray_head INIT_ARGS_JSON PARENT_PID``: run Ray until told or orphaned."""
    init_args, parent = json.loads(sys.argv[1]), int(sys.argv[2])
    stopping = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import ray

    ray.init(_node_ip_address="127.0.0.1", log_to_driver=False, **init_args)
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())  # after ray.init, which sets its own
    print(ray.get_runtime_context().gcs_address, flush=True)
    while not stopping.wait(PARENT_POLL_SECONDS) and os.getppid() == parent:
        pass
    ray.shutdown()


if __name__ == "__main__":
    main()
