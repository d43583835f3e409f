"""Everything a run starts, and stops again: Ray, the servers, SkyRL's worker groups, the models, the engine.

What differs between CPU and CUDA is asked of ``run.platform``; nothing here decides it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
from ray.util import remove_placement_group

from rllm_skyrl.checkpoint.dirs import CheckpointLock
from rllm_skyrl.checkpoint.manager import CheckpointManager, claim_checkpoints
from rllm_skyrl.ray_cluster import start_ray, stop_ray
from rllm_skyrl.rollout import weight_sync
from rllm_skyrl.rollout.engine import SkyRLEngine
from rllm_skyrl.rollout.servers import ServerGroup, start_servers
from rllm_skyrl.run.process_clock import process_started_at
from rllm_skyrl.run_config import RunConfig
from rllm_skyrl.update.models import ModelRegistry
from rllm_skyrl.update.workers import SkyRLWorkers

logger = logging.getLogger(__name__)


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
        self.engine: SkyRLEngine | None = None  # rollouts through SkyRL's client, once servers serve
        self.checkpoints: CheckpointManager | None = None
        self._checkpoint_lock: CheckpointLock | None = None
        self.placement_group: Any = None  # SkyRL's shared placement group, with colocate_all
        self.startup_seconds: dict[str, float] = {}  # how long each part of the bring-up took
        self._first_step_at: float | None = None
        self._startup_reported = False

    @classmethod
    def start(cls, run: RunConfig, tokenizer: Any = None, *, serve: bool = True) -> Runtime:
        """Bring the run up; a failure part-way stops whatever had started.

        The checkpoint directory is claimed before anything expensive: this run alone writes it (a
        lock, released at shutdown), and what it would resume from is readable. The rest is SkyRL's order
        (its trainer builds the inference client, then the models; with ``colocate_all`` the
        workers join the servers' placement group). One overlap: this package's CPU servers are
        processes of their own, launched before the workers and waited for after them, so they load
        their model while the workers load theirs. ``serve=False`` starts no servers and no engine.
        """
        started = time.perf_counter()
        runtime = cls(run, tokenizer)
        phase = runtime._phase
        try:
            with phase("tokenizer"):
                runtime.tokenizer = runtime.tokenizer or load_tokenizer(run.model_path)
            runtime.checkpoints, runtime._checkpoint_lock = claim_checkpoints(
                run.checkpoint, run.trained_roles
            )
            with phase("ray"):
                runtime.owns_ray = start_ray(
                    run.skyrl, run.log_dir, platform=run.platform, cpu_threads=run.cpu_threads
                )
            if serve:
                with phase("servers_launch"):
                    runtime.servers = start_servers(run, runtime.tokenizer)
                runtime.placement_group = getattr(runtime.servers, "placement_group", None)
            with phase("workers"):
                runtime.workers = SkyRLWorkers(
                    run.skyrl,
                    runtime.tokenizer,
                    total_training_steps=run.optimizer_steps,
                    roles=run.roles,
                    platform=run.platform,
                    placement_group=runtime.placement_group,
                )
            if serve:
                with phase("servers_ready"):
                    runtime.servers.wait_ready()
                runtime.engine = SkyRLEngine.for_servers(runtime.servers, runtime.tokenizer, run)
                weight_sync.prepare(runtime.weight_sync_method, runtime.workers, runtime.engine.client)
            runtime.models = ModelRegistry(runtime.workers)
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

    async def sync_weights(self, version: int) -> int | None:
        """``weight_sync.sync_weights`` with this run's method, workers, servers and paths."""
        return await weight_sync.sync_weights(
            self.weight_sync_method,
            self.workers,
            self.servers,
            self.run.sync_dir,
            version,
            lora_sync_path=self.run.lora.sync_path,
        )

    def shutdown(self) -> None:
        """Stop servers, workers, the shared placement group, Ray if ours, and release the checkpoint
        directory; every part even if one fails, then re-raise the first failure. Safe to call twice."""
        errors: list[BaseException] = []
        for stop in (
            self._stop_servers,
            self._stop_workers,
            self._stop_placement_group,
            self._stop_ray,
            self._stop_checkpoint_lock,
        ):
            try:
                stop()
            except BaseException as error:  # noqa: BLE001 (keep stopping the rest)
                logger.error("shutdown: %s failed: %s", stop.__name__.removeprefix("_stop_"), error)
                errors.append(error)
        if errors:
            raise errors[0]

    def _stop_checkpoint_lock(self) -> None:
        lock, self._checkpoint_lock = getattr(self, "_checkpoint_lock", None), None
        if lock is not None:
            lock.release()

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
            remove_placement_group(placement_group.pg)

    def _stop_ray(self) -> None:
        if self.owns_ray:
            stop_ray()
        self.owns_ray = False
