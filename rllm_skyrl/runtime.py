"""Everything a run starts, and stops again: Ray, SkyRL's worker groups, the model registry, the servers.

The backend, the SFT example and the tests all bring a run up through ``Runtime.start`` and take it
down through ``Runtime.shutdown``, which stops every part even when stopping one of them fails.
What differs between CPU and CUDA is asked of ``run.platform``; nothing here decides it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import ray

from rllm_skyrl import compat, stop_signals, weight_sync
from rllm_skyrl.compat import local_ray
from rllm_skyrl.hardware import Platform
from rllm_skyrl.models import ModelRegistry
from rllm_skyrl.process_clock import process_started_at
from rllm_skyrl.rollout_servers import ServerGroup, start_servers
from rllm_skyrl.run_config import RunConfig
from rllm_skyrl.secret_masking import is_secret_key
from rllm_skyrl.workers import SkyRLWorkers

logger = logging.getLogger(__name__)


def runtime_env_for(
    platform: Platform,
    skyrl_cfg: Any,
    log_dir: str | Path | None = None,
    local: bool = True,
    cpu_threads: int | None = None,
):
    """SkyRL's own worker environment variables, plus whatever the platform needs in every worker.

    ``cpu_threads``: torch threads of each worker on CPU (Ray gives an actor one per CPU it asks for).

    SkyRL forwards secrets (``WANDB_API_KEY``, ``HF_TOKEN``) through the runtime env, and Ray
    writes runtime envs into its own logs. A local Ray's workers inherit this process's
    environment anyway, so secrets are left out there; a cluster's other nodes still get them.
    """
    from skyrl.train.utils.utils import prepare_runtime_environment

    env_vars = dict(prepare_runtime_environment(skyrl_cfg))
    if local:
        env_vars = {key: value for key, value in env_vars.items() if not is_secret_key(key)}
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log_file = str(Path(log_dir).resolve() / f"infra-{datetime.now():%y%m%d_%H%M%S}.log")
        os.environ["SKYRL_LOG_FILE"] = log_file
        env_vars["SKYRL_LOG_FILE"] = log_file
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
    """Initialise Ray if this process has not; return True if we started it (and so own its shutdown).

    With ``RAY_ADDRESS`` set we join that cluster. Otherwise a CPU run uses its own Ray head
    (``compat.local_ray``: launched at the run's first line, or now), and everything else Ray's
    own ``ray.init``. The driver's patch sets are applied first (``compat.prepare_driver``):
    SkyRL registers its built-in functions when its modules are imported, and with the
    ``registries`` set they must be registered locally, before Ray is joined.
    """
    if ray.is_initialized():
        return False
    platform = platform or Platform.detect()
    compat.prepare_driver(platform)
    joining = bool(os.environ.get("RAY_ADDRESS"))
    runtime_env = runtime_env_for(platform, skyrl_cfg, log_dir, local=not joining, cpu_threads=cpu_threads)
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    init_args = platform.ray_init_args(num_cpus)
    if joining:
        logger.info("Joining Ray cluster at %s", os.environ["RAY_ADDRESS"])
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=False)
    elif not platform.cuda and compat.usable(["local_ray"]):
        local = local_ray.launched()
        if local is not None and local.init_args != init_args:
            logger.info("the Ray launched at start-up is not the one this run needs; starting another")
            local_ray.stop()
            local = None
        local = local or local_ray.launch(init_args)
        local_ray.require_token(local.token)
        ray.init(
            address=local.address(),
            _node_ip_address="127.0.0.1",
            runtime_env=runtime_env,
            log_to_driver=False,
        )
    else:
        ray.init(**init_args, runtime_env=runtime_env, log_to_driver=False)
    stop_signals.after_ray_init()  # ray.init installed its own SIGTERM handler: settle it
    return True


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


def load_tokenizer(model_path: str):
    """The model's tokenizer; rows are left-padded, so one without a pad token pads with eos."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:  # any id works as padding: masks hide it
        logger.warning(
            "tokenizer of %s has no pad token; padding with eos %r", model_path, tokenizer.eos_token
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class Runtime:
    """One run's live parts. ``models`` trains by model id; ``servers`` serve rollouts (or None)."""

    def __init__(self, run: RunConfig, tokenizer: Any) -> None:
        self.run = run
        self.tokenizer = tokenizer
        self.owns_ray = False
        self.workers: SkyRLWorkers | None = None
        self.models: ModelRegistry | None = None
        self.servers: ServerGroup | None = None
        self.placement_group: Any = None  # SkyRL's shared placement group, with colocate_all
        self.startup_seconds: dict[str, float] = {}  # how long each part of the bring-up took
        self._first_step_at: float | None = None
        self._startup_reported = False

    @classmethod
    def start(cls, run: RunConfig, tokenizer: Any = None, *, serve: bool = True) -> Runtime:
        """Ray, then the inference servers, then the workers of ``run.roles``; a failure part-way
        stops whatever had started before re-raising.

        The order is SkyRL's own (its trainer builds the inference client, then the models): with
        ``colocate_all`` (CUDA) the servers size their memory on GPUs the trainer does not use yet.
        One overlap: this package's CPU servers are processes of their own, launched before the
        workers and waited for after them, so they load their model while the workers load theirs.
        ``serve=False`` starts no servers (training only).
        """
        started = time.perf_counter()
        runtime = cls(run, tokenizer)
        phase = runtime._phase
        try:
            with phase("ray"):
                runtime.owns_ray = start_ray(
                    run.skyrl, run.log_dir, platform=run.platform, cpu_threads=run.cpu_threads
                )
            with phase("tokenizer"):
                runtime.tokenizer = runtime.tokenizer or load_tokenizer(run.model_path)
            if run.skyrl.trainer.placement.colocate_all:
                with phase("placement_group"):
                    runtime.placement_group = colocated_placement_group(run.skyrl)
            if serve:
                with phase("servers_launch"):
                    runtime.servers = start_servers(run, runtime.tokenizer, runtime.placement_group)
            with phase("workers"):
                runtime.workers = SkyRLWorkers(
                    run.skyrl,
                    runtime.tokenizer,
                    total_training_steps=run.optimizer_steps,
                    roles=run.roles,
                    platform=run.platform,
                    placement_group=runtime.placement_group,
                )
            runtime.models = ModelRegistry(runtime.workers)
            if serve:
                with phase("servers_ready"):
                    runtime.servers.wait_ready()
        except BaseException:
            runtime.shutdown()
            raise
        runtime.startup_seconds["total"] = time.perf_counter() - started
        logger.info(
            "runtime up in %.1f s (%s)",
            runtime.startup_seconds["total"],
            ", ".join(f"{name} {seconds:.1f} s" for name, seconds in runtime.startup_seconds.items()),
        )
        return runtime

    @property
    def weight_sync_method(self) -> str:
        return self.run.platform.weight_sync_method(lora=self.run.lora.enabled)

    def mark_first_step(self) -> None:
        if self._first_step_at is None:
            self._first_step_at = time.time()

    def startup_metrics(self) -> dict[str, float]:
        """``time/startup/*`` once, after the first step: each part of the bring-up, and the whole
        way from process start to the first step (imports and config included)."""
        if self._startup_reported or self._first_step_at is None:
            return {}
        self._startup_reported = True
        metrics = {f"time/startup/{name}": seconds for name, seconds in self.startup_seconds.items()}
        metrics["time/startup/process_to_first_step"] = self._first_step_at - process_started_at()
        return metrics

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.startup_seconds[name] = time.perf_counter() - start

    def connect_weight_sync(self, client: Any) -> None:
        """Once the rollout client exists: wire SkyRL's transfer to it, where that is the method."""
        weight_sync.prepare(self.weight_sync_method, self.workers, client)

    async def sync_weights(self, version: int) -> int | None:
        """Make every server sample from the workers' current policy, labelled ``version``.

        Returns the bytes the servers read (None when SkyRL moves the weights in memory).
        """
        return await weight_sync.sync_weights(
            self.weight_sync_method,
            self.workers,
            self.servers,
            self.run.sync_dir,
            version,
            lora_sync_path=self.run.lora.sync_path,
        )

    def shutdown(self) -> None:
        """Stop servers, workers, the shared placement group, then Ray if we started it; every part
        even if one fails.

        Safe to call twice. The first failure is re-raised once everything was tried.
        """
        errors: list[BaseException] = []
        for stop in (self._stop_servers, self._stop_workers, self._stop_placement_group, self._stop_ray):
            try:
                stop()
            except BaseException as error:  # noqa: BLE001 (keep stopping the rest)
                logger.error("shutdown: %s failed: %s", stop.__name__.removeprefix("_stop_"), error)
                errors.append(error)
        if errors:
            raise errors[0]

    def _stop_servers(self) -> None:
        servers, self.servers = self.servers, None
        if servers is not None:
            servers.stop()

    def _stop_workers(self) -> None:
        workers, self.workers, self.models = self.workers, None, None
        if workers is not None:
            workers.shutdown()

    def _stop_placement_group(self) -> None:
        placement_group, self.placement_group = self.placement_group, None
        if placement_group is not None and ray.is_initialized():
            from ray.util import remove_placement_group

            remove_placement_group(placement_group.pg)

    def _stop_ray(self) -> None:
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
        if self.owns_ray:
            local_ray.stop()
        self.owns_ray = False
