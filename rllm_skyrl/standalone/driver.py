"""An on-policy ``UnifiedTrainer`` with rLLM's call order, for when rLLM itself is not installed.

Construction mirrors ``rllm/trainer/unified_trainer.py``: the backend gets the FULL config,
validates it before anything starts, the tracker starts, the dataloaders are built, the backend
starts inference (``init_rollout_engine``) and a ``WorkflowEngine`` is built over the engine it
returns. ``fit()`` then drives the backend hooks in the order listed in ``protocol.py``.
Only rLLM's on-policy mode exists here; rejection sampling and fully-async training are refused.

Config keys read (all optional; defaults in brackets are rLLM's ``rllm/base.yaml`` unless noted)::

    rllm.data.train_batch_size [64]      tasks per step (each rolled out rllm.rollout.n times by the backend)
    rllm.data.val_batch_size [-1]        tasks per validation batch; -1 = the whole val set
    rllm.data.seed [0]                   shuffle seed of the train loader
    rllm.trainer.total_epochs [10]
    rllm.trainer.total_batches [-1]      stop after this many steps; -1 = total_epochs full epochs
    rllm.trainer.test_freq [5]           validate every N steps and after the last; 0 = never
    rllm.trainer.val_before_train [false]
    rllm.trainer.val_only [false]        validate once, then return from fit()
    rllm.trainer.logger [[console]]      any of console, wandb (metrics.jsonl is always written)
    rllm.trainer.project_name [rllm-training], rllm.trainer.experiment_name [default]
    rllm.trainer.run_dir                 (ours) metrics.jsonl/config.json/wandb; default
                                         logs/<project_name>/<experiment_name>
    rllm.trainer.wandb_mode              (ours) offline [default] | online (needs WANDB_API_KEY) | disabled
    rllm.rollout.n_val [1]               names the val/<source>/pass@<n_val> metric
    rllm.workflow.n_parallel_tasks [256] rollouts in flight at once
    rllm.workflow.retry_limit [1 here; rLLM 3]      attempts per rollout that ends in error
    rllm.workflow.raise_on_error [false here; rLLM true]  raise instead of counting failed rollouts
    rllm.algorithm.*, rllm.stepwise_advantage.mode [broadcast]  -> AlgorithmConfig
    rllm.compact_filtering.*             -> CompactFilteringConfig (masks episodes by termination reason)
    rllm.transform.*                     -> TransformConfig (trajectory name imputation)
    rllm.rejection_sample.enable [false], rllm.async_training.enable [false]  must stay false

``rllm.rollout.n`` / ``n_val`` are read by the backend's ``generate_episodes``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm_skyrl.standalone.config import (
    AlgorithmConfig,
    CompactFilteringConfig,
    RejectionSamplingConfig,
    TransformConfig,
)
from rllm_skyrl.standalone.dataloader import StatefulTaskDataLoader, load_rows
from rllm_skyrl.standalone.episodes import (
    episode_metrics,
    group_trajectories,
    reward_metrics,
    validation_metrics,
)
from rllm_skyrl.standalone.protocol import BackendProtocol
from rllm_skyrl.standalone.state import TrainerState
from rllm_skyrl.standalone.tracking import Tracking
from rllm_skyrl.standalone.workflow import Workflow, WorkflowEngine

logger = logging.getLogger(__name__)


@contextmanager
def _timed(name: str, timing: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = time.perf_counter() - start


def _as_list(value: Any) -> list[str]:
    """rLLM accepts ``trainer.logger`` as one name or a list of names."""
    return [value] if isinstance(value, str) else list(value)


class UnifiedTrainer:
    """Runs workflows through a backend, on-policy: generate, transform, process, advantages, update."""

    def __init__(
        self,
        backend_cls: type[BackendProtocol],
        config: DictConfig,
        workflow_class: type[Workflow],
        train_dataset: Any = None,
        val_dataset: Any = None,
        workflow_args: dict[str, Any] | None = None,
        backend_args: dict[str, Any] | None = None,
    ) -> None:
        """Datasets are lists of task dicts, DataFrames or parquet paths (see ``load_rows``)."""
        self.config = config if isinstance(config, DictConfig) else OmegaConf.create(config)
        self.backend = backend_cls(config=self.config, **(backend_args or {}))
        self.backend.validate_config()  # the backend's one-line refusals first (they start nothing)
        self._check_supported_modes()

        self.algorithm_config = AlgorithmConfig.from_config(
            self._get("rllm.algorithm"),
            stepwise_advantage_mode=self._get("rllm.stepwise_advantage.mode", "broadcast"),
        )
        self.cf_config = CompactFilteringConfig.from_config(self._get("rllm.compact_filtering"))
        self.transform_config = TransformConfig.from_config(self._get("rllm.transform"))
        self.rs_config = RejectionSamplingConfig.from_config(self._get("rllm.rejection_sample"))

        project = self._get("rllm.trainer.project_name", "rllm-training")
        experiment = self._get("rllm.trainer.experiment_name", "default")
        self.tracking = Tracking(
            run_dir=self._get("rllm.trainer.run_dir", f"logs/{project}/{experiment}"),
            project_name=project,
            experiment_name=experiment,
            loggers=_as_list(self._get("rllm.trainer.logger", ["console"])),
            config=OmegaConf.to_container(self.config, resolve=True, throw_on_missing=False),
            wandb_mode=self._get("rllm.trainer.wandb_mode"),
        )

        self._init_dataloaders(train_dataset, val_dataset)
        rollout_engine = self.backend.init_rollout_engine(
            cf_config=self.cf_config,
            transform_config=self.transform_config,
            rs_config=self.rs_config,
            algorithm_config=self.algorithm_config,
            total_training_steps=self.total_training_steps,
        )
        self.agent_workflow_engine = WorkflowEngine(
            workflow_cls=workflow_class,
            workflow_args=workflow_args,
            rollout_engine=rollout_engine,
            n_parallel_tasks=self._get("rllm.workflow.n_parallel_tasks", 256),
            retry_limit=self._get("rllm.workflow.retry_limit", 1),
            raise_on_error=self._get("rllm.workflow.raise_on_error", False),
        )
        self.tokenizer = getattr(self.backend, "tokenizer", None)

    def _get(self, key: str, default: Any = None) -> Any:
        return OmegaConf.select(self.config, key, default=default)

    def _check_supported_modes(self) -> None:
        if self._get("rllm.async_training.enable", False):
            raise ValueError(
                "rllm.async_training.enable=true: this driver runs on-policy only; use rLLM's trainer"
            )
        if self._get("rllm.rejection_sample.enable", False):
            raise ValueError(
                "rllm.rejection_sample.enable=true is not supported by this driver; set it to false"
            )
        mode = self._get("rllm.stepwise_advantage.mode", "broadcast")
        if mode != "broadcast":
            raise ValueError(f"rllm.stepwise_advantage.mode={mode!r}: only 'broadcast' is supported")

    def _init_dataloaders(self, train_dataset: Any, val_dataset: Any) -> None:
        self.train_dataloader: StatefulTaskDataLoader | None = None
        self.val_dataloader: StatefulTaskDataLoader | None = None
        self.total_epochs: int = self._get("rllm.trainer.total_epochs", 10)
        self.total_training_steps = 0
        if train_dataset is not None:
            batch_size = self._get("rllm.data.train_batch_size", 64)
            self.train_dataloader = StatefulTaskDataLoader(
                train_dataset, batch_size, shuffle=True, seed=self._get("rllm.data.seed", 0), drop_last=True
            )
            if len(self.train_dataloader) == 0:
                raise ValueError(
                    f"train dataset has {len(self.train_dataloader.rows)} rows, fewer than "
                    f"rllm.data.train_batch_size={batch_size}; no full batch can be drawn"
                )
            total_batches = self._get("rllm.trainer.total_batches", -1)
            epoch_steps = len(self.train_dataloader) * self.total_epochs
            self.total_training_steps = total_batches if total_batches and total_batches > 0 else epoch_steps
        if val_dataset is not None:
            val_rows = load_rows(val_dataset)
            val_batch_size = self._get("rllm.data.val_batch_size", -1)
            if val_batch_size == -1:
                val_batch_size = max(len(val_rows), 1)
            self.val_dataloader = StatefulTaskDataLoader(
                val_rows, val_batch_size, shuffle=False, drop_last=False
            )

    # ------------------------------------------------------------------ run

    def fit(self) -> None:
        """Train to the end (synchronous entry point); call ``shutdown()`` afterwards."""
        asyncio.run(self.fit_async())

    async def fit_async(self) -> None:
        state = TrainerState(train_dataloader=self.train_dataloader, total_steps=self.total_training_steps)
        await self.backend.on_train_start(state)  # may resume: global_step and the loader position
        self.tracking.start(self.total_training_steps, resume_step=state.global_step)
        try:
            await self._run(state)
        except BaseException:
            try:
                await self.backend.on_train_end(state)
            except Exception:  # keep the original failure as the one the caller sees
                logger.exception("on_train_end failed after training had already failed")
            raise
        await self.backend.on_train_end(state)

    async def _run(self, state: TrainerState) -> None:
        if self._get("rllm.trainer.val_before_train", True):
            await self._validate(state)
        if self._get("rllm.trainer.val_only", False):
            return
        state.global_step += 1  # steps are 1-based; a resumed global_step is the last one completed
        await self._fit_on_policy(state)

    async def _fit_on_policy(self, state: TrainerState) -> None:
        """rLLM's on-policy loop: periodic validation every ``test_freq`` steps (not after the step
        that reaches ``total_batches``), and one more validation after the last step."""
        loader = self.train_dataloader
        if loader is None:
            raise ValueError("fit() needs a train_dataset")
        total_batches = self._get("rllm.trainer.total_batches", -1) or -1
        test_freq = self._get("rllm.trainer.test_freq", 5)
        state.total_steps = self.total_training_steps
        stop = False
        for epoch in range(loader.epoch, self.total_epochs):
            if stop:
                break
            state.epoch = epoch
            await self.backend.on_epoch_start(state)
            for batch in loader:
                await self._train_step(batch, state)
                if total_batches > 0 and state.global_step >= total_batches:
                    stop = True
                    break
                if test_freq > 0 and state.global_step % test_freq == 0:
                    await self._validate(state)
                state.global_step += 1
            await self.backend.on_epoch_end(state)
        if test_freq > 0:
            await self._validate(state)

    async def _train_step(self, batch: list[dict[str, Any]], state: TrainerState) -> None:
        state.reset_batch()
        await self.backend.on_batch_start(state)
        with _timed("step", state.timing_dict):
            await self._train_batch(batch, state)
        await self.backend.on_batch_end(state)
        self.tracking.log(state.metrics, step=state.global_step)

    async def _train_batch(self, batch: list[dict[str, Any]], state: TrainerState) -> None:
        state.episodes = await self.backend.generate_episodes(
            batch, agent_workflow_engine=self.agent_workflow_engine, is_validation=False
        )
        if not state.episodes:
            return
        state.metrics.update(episode_metrics(state.episodes))
        groups, group_metrics = group_trajectories(state.episodes, self.transform_config, self.cf_config)
        state.metrics.update(group_metrics)
        # rLLM drops groups too small to compare rollouts in (rejection_sample.min_trajs_per_group).
        kept = [g for g in groups if len(g.trajectories) >= self.rs_config.min_trajs_per_group]
        state.metrics["batch/groups_dropped_insufficient_trajs"] = float(len(groups) - len(kept))
        state.trajectory_groups = kept
        if not kept:
            logger.warning(
                "step %d: no trainable trajectory groups; skipping the policy update", state.global_step
            )
            return

        state.backend_batch = self.backend.transform_to_backend_batch(state)
        await self.backend.process_backend_batch(state)
        if state.backend_batch is None:
            raise RuntimeError(
                f"{type(self.backend).__name__}.process_backend_batch left trainer_state.backend_batch empty"
            )
        await self.backend.compute_advantages(state, self.algorithm_config)
        await self.backend.update_policy(state)

    async def _validate(self, state: TrainerState) -> None:
        """Roll out the whole val set and log ``val/<source>/pass@1``, ``pass@<n_val>``, ``val/reward/*``."""
        if self.val_dataloader is None or not await self.backend.on_validation_start(state):
            return
        try:
            start = time.perf_counter()
            episodes = []
            for batch in self.val_dataloader:
                episodes += await self.backend.generate_episodes(
                    batch, agent_workflow_engine=self.agent_workflow_engine, is_validation=True
                )
            groups, _ = group_trajectories(episodes, self.transform_config, self.cf_config)
            metrics = validation_metrics(episodes, n_val=self._get("rllm.rollout.n_val", 1))
            metrics.update({f"val/{key}": value for key, value in reward_metrics(groups).items()})
            metrics["time/testing"] = time.perf_counter() - start
        finally:
            await self.backend.on_validation_end(state)
        self.tracking.log(metrics, step=state.global_step)

    def shutdown(self) -> None:
        """Stop the backend (synchronously) and close the loggers."""
        try:
            self.backend.shutdown()
        finally:
            self.tracking.finish()
