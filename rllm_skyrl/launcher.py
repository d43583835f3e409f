"""Ray bring-up: start a local Ray, or join an existing cluster, exactly once per process.

SkyRL's workers are Ray actors that ask for GPUs. On a machine without CUDA we
start Ray with *logical* GPUs (a scheduling token, nothing more) so the same
placement code runs, and register the CPU patches as a worker setup hook so
every actor process applies them before importing SkyRL's workers.
"""

from __future__ import annotations

import logging
import os
from datetime import datetime
from pathlib import Path

import ray

from rllm_skyrl.compat import cpu

logger = logging.getLogger(__name__)

# Logical GPUs offered on a CPU-only machine: enough for policy, critic and ref at
# data-parallel size 2 each. They only gate scheduling; nothing runs on them.
CPU_LOGICAL_GPUS = 8


def runtime_env_for(skyrl_cfg, log_dir: str | None = None) -> dict:
    """SkyRL's own worker environment variables, plus our CPU hook when CUDA is absent."""
    from skyrl.train.utils.utils import prepare_runtime_environment

    env_vars = dict(prepare_runtime_environment(skyrl_cfg))
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log_file = str(Path(log_dir).resolve() / f"infra-{datetime.now():%y%m%d_%H%M%S}.log")
        os.environ["SKYRL_LOG_FILE"] = log_file
        env_vars["SKYRL_LOG_FILE"] = log_file
    return {"env_vars": env_vars, **cpu.ray_runtime_env()}


def start_ray(skyrl_cfg, log_dir: str | None = None, num_cpus: int | None = None) -> bool:
    """Initialise Ray if this process has not; return True if we started it (and so own its shutdown).

    With ``RAY_ADDRESS`` set we join that cluster; otherwise a local Ray is started.
    """
    if ray.is_initialized():
        return False
    cpu.apply()
    runtime_env = runtime_env_for(skyrl_cfg, log_dir)
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    if os.environ.get("RAY_ADDRESS"):
        logger.info("Joining Ray cluster at %s", os.environ["RAY_ADDRESS"])
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=False)
    else:
        resources: dict = {}
        if not cpu.cuda_available():
            resources = {"num_gpus": CPU_LOGICAL_GPUS, "num_cpus": num_cpus or CPU_LOGICAL_GPUS}
        ray.init(runtime_env=runtime_env, log_to_driver=False, include_dashboard=False, **resources)

    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries

    sync_registries()
    return True
