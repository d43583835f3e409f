"""Everything a run starts, and stops again: Ray, SkyRL's worker groups, the model registry, the servers.

The backend, the SFT example and the tests all bring a run up through ``Runtime.start`` and take it
down through ``Runtime.shutdown``, which stops every part even when stopping one of them fails.
What differs between CPU and CUDA is asked of ``run.platform``; nothing here decides it.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import ray

from rllm_skyrl import compat, ray_head, stop_signals, weight_sync
from rllm_skyrl.hardware import Platform
from rllm_skyrl.models import ModelRegistry
from rllm_skyrl.process_clock import process_started_at
from rllm_skyrl.rollout_servers import ServerGroup, start_servers
from rllm_skyrl.run_config import RunConfig
from rllm_skyrl.secret_masking import is_secret_key
from rllm_skyrl.workers import SkyRLWorkers, start_early, stop_early

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
    platform_env = platform.ray_runtime_env()
    return {**platform_env, "env_vars": {**env_vars, **platform_env.get("env_vars", {})}}


def start_ray(
    skyrl_cfg: Any,
    log_dir: str | Path | None = None,
    num_cpus: int | None = None,
    platform: Platform | None = None,
    cpu_threads: int | None = None,
    on_connected: Callable[[], None] | None = None,
) -> bool:
    """Initialise Ray if this process has not; return True if we started it (and so own its shutdown).

    With ``RAY_ADDRESS`` set we join that cluster; otherwise the local Ray launched at the run's
    first line (``ray_head``) if it has what this run needs, else one launched now.
    ``on_connected`` runs as soon as this process is connected. SkyRL's function registries are
    shared through Ray's key-value store (``compat.registries``), set up before Ray is joined.
    """
    if ray.is_initialized():
        return False
    compat.apply(["registries_in_gcs"])  # SkyRL registers its built-ins on import: locally, before Ray

    platform = platform or Platform.detect()
    joining = bool(os.environ.get("RAY_ADDRESS"))
    runtime_env = runtime_env_for(platform, skyrl_cfg, log_dir, local=not joining, cpu_threads=cpu_threads)
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    init_args = ray_head.local_init_args(platform, num_cpus)
    local = ray_head.launched()
    if local is not None and (joining or local.init_args != init_args):
        logger.info("the Ray launched at start-up is not the one this run needs; starting another")
        ray_head.stop()
        local = None
    if joining:
        logger.info("Joining Ray cluster at %s", os.environ["RAY_ADDRESS"])
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=False)
    else:
        local = local or ray_head.launch(init_args)
        ray_head.require_token(local.token)
        address = local.address()
        ray.init(address=address, _node_ip_address="127.0.0.1", runtime_env=runtime_env, log_to_driver=False)

    stop_signals.after_ray_init()  # from the main thread ray.init installed its own SIGTERM handler
    if on_connected is not None:
        on_connected()
    return True


def _drop_sigterm_note(record: logging.LogRecord) -> bool:
    """Ray's warning that ``ray.init`` outside the main thread set no SIGTERM handler:
    ``Runtime.start`` does so on purpose and settles SIGTERM itself (``stop_signals``)."""
    return "SIGTERM handler is not set" not in record.getMessage()


class _RayStarter:
    """``start_ray`` off the main thread, with ``then()`` (the workers' early actors) once Ray is up,
    in a thread that lives until Ray is stopped.

    Ray binds its daemons' lives to their parent with ``PR_SET_PDEATHSIG``, and Linux sends that
    signal when the *thread* that started them exits: a pool thread going idle killed the raylet
    mid-run. So this thread waits, once Ray is up, until ``release`` (after ``ray.shutdown``).
    """

    def __init__(self, then: Callable[[], Any] | None = None, **start_ray_args: Any) -> None:
        self.started: Future = Future()
        self.then: Future = Future()  # what ``then`` returned, once Ray is up
        self._released = threading.Event()
        self._ray_was_up = ray.is_initialized()
        threading.Thread(
            target=self._run, args=(then,), kwargs=start_ray_args, name="ray-start", daemon=True
        ).start()

    def _run(self, then: Callable[[], Any] | None, **start_ray_args: Any) -> None:
        logging.getLogger("ray._private.worker").addFilter(_drop_sigterm_note)

        def run_then() -> None:
            try:
                self.then.set_result(then())
            except BaseException as error:  # noqa: BLE001  (handed to the waiting thread)
                self.then.set_exception(error)

        try:
            self.started.set_result(
                start_ray(**start_ray_args, on_connected=run_then if then is not None else None)
            )
        except BaseException as error:  # noqa: BLE001
            self.started.set_exception(error)
            if not self.then.done():
                self.then.set_exception(error)
        if not self.then.done() and then is not None:  # Ray was up already: start_ray started nothing
            run_then()
        elif not self.then.done():
            self.then.set_result(None)
        self._released.wait()

    def then_result(self) -> Any:
        """What ``then`` returned, or None if it failed or has not run."""
        if not self.then.done() or self.then.exception() is not None:
            return None
        return self.then.result()

    def owns_ray(self) -> bool:
        """Wait for the start; whether it started Ray (also if it failed after ``ray.init``)."""
        try:
            return self.started.result()
        except BaseException:
            return not self._ray_was_up and ray.is_initialized()

    def release(self) -> None:
        self._released.set()


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
        self._ray_starter: _RayStarter | None = None

    @classmethod
    def start(cls, run: RunConfig, tokenizer: Any = None, *, serve: bool = True) -> Runtime:
        """Ray, the workers of ``run.roles`` and (``serve``) the inference servers.

        On two cores the bring-up is bound by CPU, so the parts are ordered to keep both busy
        without crowding the slowest chain (Ray, then the training worker's imports and model):
        Ray's daemons start while this process imports SkyRL's worker modules, and as soon as Ray
        is up each worker group's first actor is created (``workers.start_early``), so that its
        process imports beside this one instead of after it; this package's CPU
        servers (separate processes that need no Ray) are launched once Ray is up and load their
        model while the workers' processes import and build theirs, as does the tokenizer here.
        Launched before Ray instead, a server's imports competed with Ray's daemons and the
        bring-up took 1-2 s longer. SkyRL's vLLM servers are Ray actors and start after Ray; with
        ``colocate_all`` (CUDA) in SkyRL's order: the shared placement group, the servers (they
        size their memory on GPUs the trainer does not use yet), then the workers. A failure
        part-way stops whatever had started before re-raising.
        """
        started = time.perf_counter()
        runtime = cls(run, tokenizer)
        phase = runtime._phase
        try:
            compat.apply(["package_index", "lazy_imports"])  # before transformers and SkyRL's modules
            colocated = run.skyrl.trainer.placement.colocate_all
            if colocated and runtime.tokenizer is None:  # SkyRL's vLLM servers start before the workers
                with phase("tokenizer"):
                    runtime.tokenizer = load_tokenizer(run.model_path)
            with phase("imports"):
                # SkyRL's function registries first: they register their built-ins on import, and
                # must be in Ray's key-value store before Ray is joined (see ``start_ray``).
                compat.apply(["registries_in_gcs"])

                runtime._ray_starter = _RayStarter(
                    then=lambda: start_early(run.skyrl, run.roles),
                    skyrl_cfg=run.skyrl,
                    log_dir=run.log_dir,
                    platform=run.platform,
                    cpu_threads=run.cpu_threads,
                )
                run.platform.prepare_process()
            with phase("ray"):
                runtime.owns_ray = runtime._ray_starter.started.result()
                stop_signals.after_ray_init()
            if serve and not colocated and run.platform.server_kind(run.inference.urls) == "cpu_transformers":
                with phase("servers_launch"):
                    runtime.servers = start_servers(run, runtime.tokenizer)
            if colocated:
                with phase("placement_group"):
                    runtime.placement_group = colocated_placement_group(run.skyrl)
                if serve:
                    with phase("servers_launch"):
                        runtime.servers = start_servers(run, runtime.tokenizer, runtime.placement_group)
            with phase("workers"), ThreadPoolExecutor(max_workers=1) as pool:
                # The tokenizer loads while the workers' processes import and build the model (this
                # thread waits on Ray meanwhile, without the GIL).
                loading = pool.submit(load_tokenizer, run.model_path) if runtime.tokenizer is None else None
                runtime.workers = SkyRLWorkers(
                    run.skyrl,
                    runtime.tokenizer,
                    total_training_steps=run.optimizer_steps,
                    roles=run.roles,
                    platform=run.platform,
                    placement_group=runtime.placement_group,
                    early=runtime._ray_starter.then.result(),
                )
                if loading is not None:
                    runtime.tokenizer = loading.result()
                    runtime.workers.use_tokenizer(runtime.tokenizer)
            runtime.models = ModelRegistry(runtime.workers)
            if serve:
                with phase("servers_ready"):
                    if runtime.servers is None:
                        runtime.servers = start_servers(run, runtime.tokenizer)
                    # Until the servers serve this process has nothing else to do: what is alive
                    # now (torch, transformers, Ray, SkyRL) lives for the whole run, and collected
                    # and frozen here, full collections skip it. Done at the first step instead,
                    # the collection (0.2 s) held up the start.
                    gc.collect()
                    gc.freeze()
                    runtime.servers.wait_ready()
        except BaseException:
            if runtime._ray_starter is not None and not runtime.owns_ray:  # stopped while Ray came up
                runtime.owns_ray = runtime._ray_starter.owns_ray()
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
        elif self._ray_starter is not None and ray.is_initialized():  # stopped before the workers took them
            stop_early(self._ray_starter.then_result() or {})

    def _stop_placement_group(self) -> None:
        placement_group, self.placement_group = self.placement_group, None
        if placement_group is not None and ray.is_initialized():
            from ray.util import remove_placement_group

            remove_placement_group(placement_group.pg)

    def _stop_ray(self) -> None:
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
        if self.owns_ray:
            ray_head.stop()
        self.owns_ray = False
        if self._ray_starter is not None:
            self._ray_starter.release()
