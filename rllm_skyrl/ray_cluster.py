"""The run's Ray: joined, or started for it, with the runtime env every worker needs."""

from __future__ import annotations

import logging
import os
import socket
from datetime import datetime
from pathlib import Path
from typing import Any

import ray

from rllm_skyrl import compat
from rllm_skyrl.compat import local_ray
from rllm_skyrl.errors import UserFacingError
from rllm_skyrl.hardware import Platform
from rllm_skyrl.run.bytecode import warn_if_compiled_at_every_start
from rllm_skyrl.secret_masking import is_secret_key

logger = logging.getLogger(__name__)

REACH_SECONDS = 5.0


class RayAddressError(UserFacingError):
    """``RAY_ADDRESS`` names a cluster nothing answers for: Ray itself would retry for minutes."""


def check_reachable(address: str) -> None:
    """Raise ``RayAddressError`` unless something accepts a connection at ``address`` (``host:port``,
    or ``ray://host:port``); Ray's other forms (``auto``, ``local``) are left to Ray."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_SECONDS).close()
    except OSError as error:
        raise RayAddressError(
            f"RAY_ADDRESS={address}: no Ray cluster answers there ({error.strerror or error}); start "
            "that cluster (ray start --head), or unset RAY_ADDRESS and the run starts a Ray of its own"
        ) from None


def runtime_env_for(
    platform: Platform,
    skyrl_cfg: Any,
    log_dir: str | Path | None = None,
    local: bool = True,
    cpu_threads: int | None = None,
):
    """SkyRL's worker environment variables plus the platform's; ``cpu_threads``: torch threads of
    each CPU worker (Ray gives an actor one per CPU it asks for). SkyRL forwards secrets (``HF_TOKEN``,
    ``WANDB_API_KEY``) in it and Ray logs it: a local Ray, whose workers inherit them anyway, gets none."""
    from skyrl.train.utils.utils import prepare_runtime_environment

    env_vars = dict(prepare_runtime_environment(skyrl_cfg))
    if local:
        env_vars = {key: value for key, value in env_vars.items() if not is_secret_key(key)}
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log_file = str(Path(log_dir).resolve() / f"infra-{datetime.now():%y%m%d_%H%M%S}.log")
        os.environ["SKYRL_LOG_FILE"] = env_vars["SKYRL_LOG_FILE"] = log_file
    if cpu_threads and not platform.cuda:
        env_vars["OMP_NUM_THREADS"] = str(cpu_threads)
    platform_env = compat.ray_runtime_env(platform)
    return {**platform_env, "env_vars": {**env_vars, **platform_env.get("env_vars", {})}}


def start_ray(
    skyrl_cfg: Any,
    log_dir: str | Path | None = None,
    num_cpus: int | None = None,
    platform: Platform | None = None,
    cpu_threads: int | None = None,
) -> bool:
    """Initialise Ray if this process has not; True if we started it (and so own its shutdown).

    A CPU run joins its own head (the ``local_ray`` set: launched at the run's first line, or now);
    after ``ray.init`` the ``sigterm`` set replaces Ray's SIGTERM handler. The driver's patch sets
    come first: with the ``registries`` set, SkyRL's built-in functions (registered when its modules
    are imported) must be registered locally before Ray is joined.
    """
    warn_if_compiled_at_every_start()  # every run's processes start from here
    if ray.is_initialized():
        return False
    platform = platform or Platform.detect()
    joining = bool(os.environ.get("RAY_ADDRESS"))
    if joining:
        check_reachable(os.environ["RAY_ADDRESS"])
    runtime_env = runtime_env_for(platform, skyrl_cfg, log_dir, local=not joining, cpu_threads=cpu_threads)
    compat.prepare_driver(platform)
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    if joining:
        logger.info("Joining Ray cluster at %s", os.environ["RAY_ADDRESS"])
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=False)
    elif not compat.apply(["local_ray"], platform, num_cpus, runtime_env, platform=platform):
        ray.init(**platform.ray_init_args(num_cpus), runtime_env=runtime_env, log_to_driver=False)
    compat.apply(["sigterm"])  # ray.init installed its own SIGTERM handler
    return True


def stop_ray() -> None:
    """Shut down the Ray ``start_ray`` started (and the CPU run's own head behind it)."""
    if ray.is_initialized():
        ray.shutdown()
    local_ray.stop()
