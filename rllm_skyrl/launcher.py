"""Ray bring-up: start a local Ray, or join an existing cluster, exactly once per process.

SkyRL's workers are Ray actors that ask for GPUs. On a machine without CUDA we
start Ray with *logical* GPUs (a scheduling token, nothing more) so the same
placement code runs, and register the CPU patches as a worker setup hook so
every actor process applies them before importing SkyRL's workers.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
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


def quiet_libraries(level: str | None = None) -> None:
    """Keep the console for the run itself: SkyRL's start-up notes and per-request HTTP lines go.

    ``RLLM_SKYRL_LOG_LEVEL=INFO`` brings them back; infrastructure logs are also in the run's
    ``logs/`` directory.
    """
    level = (level or os.environ.get("RLLM_SKYRL_LOG_LEVEL") or "WARNING").upper()
    for name in ("httpx", "skyrl", "ray"):
        logging.getLogger(name).setLevel(level)
    from loguru import logger as loguru_logger

    loguru_logger.remove()
    loguru_logger.add(sys.stderr, level=level)


def hydra_cli_overrides() -> list[str]:
    """The command-line overrides of the running Hydra app (empty outside one)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _import(path: str | type) -> type:
    if not isinstance(path, str):
        return path
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def run(
    cfg,
    workflow_class: str | type,
    workflow_args: dict | None = None,
    train_dataset=None,
    val_dataset=None,
) -> Path:
    """Train with ``SkyRLBackend`` under the unified trainer; returns the run directory.

    Uses this package's trainer (rLLM's call order and types); the backend is the same class
    rLLM's own ``UnifiedTrainer`` takes as ``backend_cls``.
    """
    from rllm_skyrl.backend import SkyRLBackend
    from rllm_skyrl.trainer import UnifiedTrainer
    from rllm_skyrl.trainer.tracking import read_metrics

    quiet_libraries()
    trainer = UnifiedTrainer(
        backend_cls=SkyRLBackend,
        config=cfg,
        workflow_class=_import(workflow_class),
        workflow_args=workflow_args,
        train_dataset=train_dataset,
        val_dataset=val_dataset,
        backend_args={"cli_overrides": hydra_cli_overrides()},
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    run_dir = Path(trainer.tracking.run_dir)
    print_summary(run_dir, read_metrics(run_dir))
    return run_dir


def print_summary(run_dir: Path, records: list[dict]) -> None:
    """A few lines a user can act on: where the run is, and whether reward went up."""
    train = [r for r in records if "reward/mean" in r]
    lines = [f"run directory: {run_dir}", f"metrics: {run_dir / 'metrics.jsonl'}"]
    if train:
        window = max(1, min(10, len(train) // 4))
        first = sum(r["reward/mean"] for r in train[:window]) / window
        last = sum(r["reward/mean"] for r in train[-window:]) / window
        lines.append(
            f"steps: {train[-1]['step']}  reward/mean: {first:.3f} (first {window} steps) "
            f"-> {last:.3f} (last {window})"
        )
    validation = {
        k: v for k, v in (records[-1] if records else {}).items() if k.startswith("val/") and "pass@" in k
    }
    lines += [f"{key}: {value:.3f}" for key, value in sorted(validation.items())]
    print("\n".join(lines), flush=True)
