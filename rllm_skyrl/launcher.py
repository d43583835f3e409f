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


def runtime_env_for(skyrl_cfg, log_dir: str | None = None, local: bool = True) -> dict:
    """SkyRL's own worker environment variables, plus our CPU hook when CUDA is absent.

    SkyRL forwards secrets (``WANDB_API_KEY``, ``HF_TOKEN``) through the runtime env, and Ray
    writes runtime envs into its own logs. A local Ray's workers inherit this process's
    environment anyway, so secrets are left out there; a cluster's other nodes still get them.
    """
    from skyrl.train.utils.utils import prepare_runtime_environment

    from rllm_skyrl.trainer.tracking import is_secret_key

    env_vars = dict(prepare_runtime_environment(skyrl_cfg))
    if local:
        env_vars = {key: value for key, value in env_vars.items() if not is_secret_key(key)}
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
    runtime_env = runtime_env_for(skyrl_cfg, log_dir, local=not os.environ.get("RAY_ADDRESS"))
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
    import skyrl.utils.log  # noqa: F401  (sets SkyRL's logger to DEBUG on import: import it first)

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


def plan(overrides: list[str], config_name: str = "unified", config_dir: str | None = None) -> str:
    """The resolved SkyRL config and the placement a GPU cluster would get; starts nothing."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from omegaconf import OmegaConf
    from skyrl.train.config.config import get_config_as_yaml_str

    from rllm_skyrl.config_bridge import skyrl_overrides
    from rllm_skyrl.workers import make_skyrl_config

    init = (
        initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None)
        if config_dir
        else initialize_config_module(config_module="rllm_skyrl.config", version_base=None)
    )
    with init:
        cfg = compose(config_name, overrides=overrides)
    skyrl_cfg = make_skyrl_config(skyrl_overrides(cfg, overrides), for_cpu=False)
    trainer = skyrl_cfg.trainer
    placement = trainer.placement
    roles = [("policy", placement.policy_num_nodes, placement.policy_num_gpus_per_node)]
    if trainer.critic.model.path:
        roles.append(("critic", placement.critic_num_nodes, placement.critic_num_gpus_per_node))
    if trainer.algorithm.use_kl_loss or trainer.algorithm.use_kl_in_reward:
        roles.append(("ref", placement.ref_num_nodes, placement.ref_num_gpus_per_node))
    urls = OmegaConf.select(cfg, "inference.urls")
    engines = len(urls) if urls else int(OmegaConf.select(cfg, "inference.num_engines", default=1))
    lines = ["# placement"]
    lines += [
        f"{role}: {nodes} node(s) x {gpus} GPU(s) = {nodes * gpus} training GPU(s)"
        for role, nodes, gpus in roles
    ]
    lines.append(
        f"inference: {engines} engine(s) "
        + (f"at {list(urls)}" if urls else "started by the backend (vLLM on GPU, transformers on CPU)")
    )
    lines.append(
        f"colocate_all: {placement.colocate_all}  colocate_policy_ref: {placement.colocate_policy_ref}"
    )
    total = sum(nodes * gpus for _, nodes, gpus in roles)
    lines.append(f"total training GPUs: {total}")
    return "\n".join(lines) + "\n\n# resolved SkyRL config\n" + get_config_as_yaml_str(skyrl_cfg)


def main(argv: list[str] | None = None) -> None:
    """``rllm-skyrl plan [--config-dir DIR] [--config-name NAME] [overrides...]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="rllm-skyrl")
    commands = parser.add_subparsers(dest="command", required=True)
    plan_parser = commands.add_parser(
        "plan", help="print the resolved SkyRL config and placement; start nothing"
    )
    plan_parser.add_argument(
        "--config-dir", default=None, help="directory of the run config (default: packaged)"
    )
    plan_parser.add_argument("--config-name", default="unified")
    plan_parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.path=Qwen/Qwen3-8B")
    args = parser.parse_args(argv)
    if args.command == "plan":
        print(plan(args.overrides, args.config_name, args.config_dir))


if __name__ == "__main__":
    main()
