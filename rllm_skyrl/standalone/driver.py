"""The trainer used when rLLM is not installed: rLLM's ``UnifiedTrainer`` call order, on-policy only.

Construction follows ``rllm/trainer/unified_trainer.py`` (the backend validates the full config
before anything starts); ``fit()`` calls the backend's hooks in rLLM's on-policy order::

    on_train_start -> validation (val_before_train) -> per epoch: on_epoch_start -> per batch:
    on_batch_start, generate_episodes, transform_to_backend_batch, process_backend_batch,
    compute_advantages, update_policy, on_batch_end, validation every test_freq steps
    -> on_epoch_end -> validation after the last step -> on_train_end (also after a failure)

What rLLM configures with its own classes is not copied: the backend gets ``None`` for
``cf_config``, ``transform_config``, ``rs_config`` and ``algorithm_config`` (and takes the
algorithm from the run config), trajectories group as rLLM's defaults group them (``episodes.py``),
and fully-async training needs rLLM. Keys and defaults are rLLM's (``config/rllm/base.yaml``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from rllm_skyrl.run.metrics import KL_KEYS
from rllm_skyrl.standalone.dataloader import StatefulTaskDataLoader
from rllm_skyrl.standalone.episodes import episode_metrics, group_trajectories, validation_metrics
from rllm_skyrl.standalone.workflow import WorkflowEngine
from rllm_skyrl.update.advantages import reward_metrics

logger = logging.getLogger(__name__)


@dataclass
class TrainerState:
    """What the trainer and the backend's hooks share (rLLM's field names); ``reset_batch`` per step."""

    global_step: int = 0
    epoch: int = 0
    total_steps: int = 0
    is_training: bool = True
    weight_version: int = 0
    train_dataloader: StatefulTaskDataLoader | None = None
    timing_dict: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)
    episodes: list[Any] | None = None
    trajectory_groups: list[Any] | None = None
    backend_batch: Any = None

    def reset_batch(self) -> None:
        self.episodes = self.trajectory_groups = self.backend_batch = None
        self.timing_dict, self.metrics, self.extra_info = {}, {}, {}


def console_line(step: int, total_steps: int, metrics: Mapping[str, Any]) -> str:
    """``step 3/20 | reward 0.412 | val/math/pass@1 0.300 | kl 0.0012 | 1.84 s/step``."""
    parts = [f"step {step}/{total_steps}"]
    if metrics.get("reward/mean") is not None:
        parts.append(f"reward {metrics['reward/mean']:.3f}")
    parts += [f"{k} {v:.3f}" for k, v in sorted(metrics.items()) if k.endswith("/pass@1") and v is not None]
    kl_key = next((key for key in KL_KEYS if metrics.get(key) is not None), None)
    if kl_key:
        parts.append(f"kl {metrics[kl_key]:.4g}")
    if metrics.get("time/step") is not None:
        parts.append(f"{metrics['time/step']:.2f} s/step")
    return " | ".join(parts)


class ConsoleLine:
    """One short line per record on the console (above any progress bar)."""

    def __init__(self, total_steps: int) -> None:
        self.total_steps = total_steps

    def log(self, data: Mapping[str, Any], step: int) -> None:
        tqdm.write(console_line(step, self.total_steps, data))


class Tracking:
    """rLLM's ``Tracking`` with the one logger this trainer has, ``console``. Like rLLM's, it hands
    each record to every entry of its ``logger`` table; ``add_sinks`` adds a run's own."""

    def __init__(self, loggers: str | list[str], total_steps: int) -> None:
        loggers = [loggers] if isinstance(loggers, str) else list(loggers)
        if set(loggers) - {"console"}:
            logger.warning(
                "without rLLM, metrics go to the console and metrics.jsonl only: %s ignored", loggers
            )
        self.logger: dict[str, Any] = {"console": ConsoleLine(total_steps)} if "console" in loggers else {}

    def add_sinks(self, sinks: Mapping[str, Any]) -> None:
        self.logger.update(sinks)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        for sink in self.logger.values():
            sink.log(data=data, step=step)


class UnifiedTrainer:
    """Runs workflows through a backend, on-policy: generate, transform, process, advantages, update."""

    def __init__(
        self,
        backend_cls: type,
        config: DictConfig,
        workflow_class: type,
        train_dataset: Any = None,
        val_dataset: Any = None,
        workflow_args: dict[str, Any] | None = None,
        backend_args: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.backend = backend_cls(config=config, **(backend_args or {}))
        self.backend.validate_config()  # the backend's one-line refusals first (they start nothing)
        if self._get("rllm.async_training.enable", False):
            raise ValueError(
                "rllm.async_training.enable=true needs rLLM's trainer; this one runs on-policy only"
            )
        self.train_dataloader = self.val_dataloader = None
        self.total_training_steps = 0
        self.total_batches = self._get("rllm.trainer.total_batches", -1) or -1
        if train_dataset is not None:
            batch_size = self._get("rllm.data.train_batch_size")
            self.train_dataloader = StatefulTaskDataLoader(
                train_dataset, batch_size, seed=self._get("rllm.data.seed", 0)
            )
            if len(self.train_dataloader) == 0:
                raise ValueError(
                    f"train dataset has {len(train_dataset)} rows, fewer than "
                    f"rllm.data.train_batch_size={batch_size}; no full batch can be drawn"
                )
            epoch_steps = len(self.train_dataloader) * self._get("rllm.trainer.total_epochs")
            self.total_training_steps = self.total_batches if self.total_batches > 0 else epoch_steps
        if val_dataset is not None:
            val_batch_size = self._get("rllm.data.val_batch_size", -1)
            batch_size = len(val_dataset) if val_batch_size == -1 else val_batch_size
            self.val_dataloader = StatefulTaskDataLoader(
                val_dataset, batch_size, shuffle=False, drop_last=False
            )
        self.logger = Tracking(self._get("rllm.trainer.logger", ["console"]), self.total_training_steps)
        rollout_engine = self.backend.init_rollout_engine(
            cf_config=None,
            transform_config=None,
            rs_config=None,
            algorithm_config=None,
            total_training_steps=self.total_training_steps,
        )
        self.agent_workflow_engine = WorkflowEngine(
            workflow_class,
            workflow_args,
            rollout_engine,
            n_parallel_tasks=self._get("rllm.workflow.n_parallel_tasks", 256),
            retry_limit=self._get("rllm.workflow.retry_limit", 1),
            raise_on_error=self._get("rllm.workflow.raise_on_error", False),
        )

    def _get(self, key: str, default: Any = None) -> Any:
        return OmegaConf.select(self.config, key, default=default)

    def fit(self) -> None:
        """Train to the end; call ``shutdown()`` afterwards."""
        asyncio.run(self.fit_async())

    async def fit_async(self) -> None:
        state = TrainerState(train_dataloader=self.train_dataloader, total_steps=self.total_training_steps)
        await self.backend.on_train_start(state)  # may resume: global_step and the loader position
        if self._get("rllm.trainer.val_before_train", True):
            await self._validate(state)
            if self._get("rllm.trainer.val_only", False):
                return
        state.global_step += 1  # steps are 1-based; a resumed global_step is the last one completed
        try:
            await self._fit_on_policy(state)
        finally:
            try:
                await self.backend.on_train_end(state)
            except Exception:  # the failure the caller sees stays the training's own
                logger.exception("%s.on_train_end failed", type(self.backend).__name__)

    async def _fit_on_policy(self, state: TrainerState) -> None:
        """Validation every ``test_freq`` steps (not after the step that reaches ``total_batches``)
        and once more after the last step, as in rLLM."""
        loader = self.train_dataloader
        if loader is None:
            raise ValueError("fit() needs a train_dataset")
        test_freq = self._get("rllm.trainer.test_freq", 5)
        stop = False
        for epoch in range(loader.epoch, self._get("rllm.trainer.total_epochs")):
            if stop:
                break
            state.epoch = epoch
            await self.backend.on_epoch_start(state)
            for batch in loader:
                state.reset_batch()
                await self.backend.on_batch_start(state)
                started = time.perf_counter()
                await self._train_batch(batch, state)
                state.timing_dict["step"] = time.perf_counter() - started
                await self.backend.on_batch_end(state)
                self.logger.log(state.metrics, step=state.global_step)
                if 0 < self.total_batches <= state.global_step:
                    stop = True
                    break
                if test_freq > 0 and state.global_step % test_freq == 0:
                    await self._validate(state)
                state.global_step += 1
            await self.backend.on_epoch_end(state)
        if test_freq > 0:
            await self._validate(state)

    async def _train_batch(self, batch: list[Any], state: TrainerState) -> None:
        state.episodes = await self.backend.generate_episodes(
            batch, agent_workflow_engine=self.agent_workflow_engine, is_validation=False
        )
        if not state.episodes:
            return
        state.metrics.update(episode_metrics(state.episodes))
        state.trajectory_groups, group_metrics = group_trajectories(state.episodes)
        state.metrics.update(group_metrics)
        if not state.trajectory_groups:
            return
        state.backend_batch = self.backend.transform_to_backend_batch(state)
        await self.backend.process_backend_batch(state)
        if state.backend_batch is None:
            raise RuntimeError(f"{type(self.backend).__name__}.process_backend_batch left no backend_batch")
        await self.backend.compute_advantages(state, None)
        await self.backend.update_policy(state)

    async def _validate(self, state: TrainerState) -> None:
        """The whole val set: ``val/<source>/pass@1``, ``pass@<n_val>`` and ``val/reward/<role>/*``."""
        if self.val_dataloader is None or not await self.backend.on_validation_start(state):
            return
        started = time.perf_counter()
        episodes = []
        for batch in self.val_dataloader:
            episodes += await self.backend.generate_episodes(
                batch, agent_workflow_engine=self.agent_workflow_engine, is_validation=True
            )
        groups, _ = group_trajectories(episodes)
        metrics = validation_metrics(episodes, n_val=self._get("rllm.rollout.n_val", 1))
        metrics.update({f"val/{key}": value for key, value in reward_metrics(groups).items()})
        metrics["time/testing"] = time.perf_counter() - started
        self.logger.log(metrics, step=state.global_step)
        await self.backend.on_validation_end(state)

    def shutdown(self) -> None:
        try:
            self.agent_workflow_engine.shutdown()
        finally:
            self.backend.shutdown()
