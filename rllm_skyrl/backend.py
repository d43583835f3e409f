"""``SkyRLBackend``: rLLM's ``BackendProtocol`` on SkyRL's trainers, workers and inference protocol.

The trainer owns the loop; this class fills in its stages (``standalone/driver.py`` lists their
order). One training step reads as the algorithm:

    generate_episodes          workflows sample from the inference servers
    transform_to_backend_batch advantages per trajectory group, episodes -> TrainingInputBatch
    process_backend_batch      critic values + GAE (PPO), loss reduction, forward_backward
    update_policy              optimizer step(s)
    on_batch_end               weight sync to the servers, checkpoint, the step's metrics

rLLM's fully-async mode calls transform/process once per chunk of a step's groups (gradients
accumulate), then ``update_policy`` once, then ``on_policy_updated`` (the weight sync), then
``on_batch_end``; rollouts keep running on the same event loop meanwhile, so every blocking call
(Ray, HTTP, disk) runs in a worker thread. What is resolved from the config is in ``run_config``;
what is started and stopped is in ``runtime``.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import sys
import weakref
from contextlib import nullcontext
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm_skyrl import compat, rllm_api
from rllm_skyrl.checkpoint.manager import CheckpointManager, failure_report
from rllm_skyrl.data.adapter import BatchConfig, EmptyBatchError, trajectory_groups_to_batch
from rllm_skyrl.data.batch_layout import stack_rows
from rllm_skyrl.rollout import gateway
from rllm_skyrl.rollout.ledger import restore_step_tokens
from rllm_skyrl.run.metrics import StepMetrics
from rllm_skyrl.run_config import RunConfig, resolve_run_config, trainer_keys_behind
from rllm_skyrl.runtime import Runtime
from rllm_skyrl.update import advantages as adv
from rllm_skyrl.update.policy_update import PolicyUpdate

logger = logging.getLogger(__name__)


class SkyRLBackend:
    """Trains with SkyRL's FSDP workers; serves rollouts through SkyRL's inference protocol.

    Reads only attributes that rLLM's own episode/trajectory/step objects have, so it runs under
    rLLM's ``UnifiedTrainer`` as well as under the fallback, ``rllm_skyrl.standalone.UnifiedTrainer``.
    """

    name = "skyrl"
    requires_loop = False
    # Backends whose runtime is up; a launcher stops them when the trainer around them fails to build.
    _running: weakref.WeakSet[SkyRLBackend] = weakref.WeakSet()

    @classmethod
    def shutdown_all(cls) -> None:
        """Stop every backend of this process that still has a runtime up."""
        for backend in list(cls._running):
            backend.shutdown()

    def __init__(self, config: DictConfig, **_: Any) -> None:
        """``config`` is the trainer's whole config; rLLM's ``backend_args`` are accepted, not used."""
        self.config = config
        self.run: RunConfig | None = None
        self.runtime: Runtime | None = None
        self.rollout_engine = None
        self.tokenizer = None
        self.checkpoints: CheckpointManager | None = None
        self.metrics = StepMetrics()
        self._algorithm_config: Any = None
        self._update: PolicyUpdate | None = None
        self._updated = False
        self._last_trained_step: int | None = None
        self.resumed_step: int | None = None  # the checkpointed step on_train_start resumed from

    # ------------------------------------------------------------------ set-up

    def validate_config(self) -> None:
        """Every check that needs no Ray, no model and no server; errors name the key to change.

        The one write into the trainer's config: rLLM's trainer reads its own ``rllm.*`` keys after
        this hook (batch sizes for its data loaders, ``rllm.algorithm`` for its advantages), so an
        alias of one (tinker's ``data.train_batch_size``) is copied onto it, as rLLM's launchers sync
        ``data.*`` into ``rllm.data.*``. This package's launchers pass ``with_aliases(cfg)`` already.
        """
        why = gateway.refusal(self.config)
        if why is not None:
            raise ValueError(why)
        self.run = resolve_run_config(self.config)
        if rllm_api.installed() and importlib.util.find_spec("rllm_model_gateway") is not None:
            compat.apply(["rllm_gateway"])  # an AgentFlow's calls go through rLLM's gateway
        for key, value in trainer_keys_behind(self.config).items():  # force_add: struct configs too
            OmegaConf.update(self.config, key, value, merge=False, force_add=True)

    def init_rollout_engine(self, **kwargs: Any):
        """Start the run (``Runtime.start``: checkpoint directory, Ray, servers, workers); return the
        rollout engine. A failure part-way leaves nothing running."""
        self._algorithm_config = kwargs.get("algorithm_config")
        run = self.run.for_total_steps(kwargs.get("total_training_steps") or 1)
        self.run = run.with_algorithm_config(self._algorithm_config)
        self.runtime = Runtime.start(self.run)
        SkyRLBackend._running.add(self)
        self.checkpoints = self.runtime.checkpoints
        self.tokenizer = self.runtime.tokenizer
        self.rollout_engine = self.runtime.engine
        try:
            self._update = PolicyUpdate(
                self.run, self.runtime.models, self.runtime.workers.dp_size("policy"), self.metrics
            )
        except BaseException:
            self.shutdown()
            raise
        return self.rollout_engine

    # ------------------------------------------------------------------ rollouts

    async def generate_episodes(
        self, batch: Any, agent_workflow_engine: Any, is_validation: bool = False, **kwargs: Any
    ):
        """Roll out each task n (or n_val) times under one task id, as rLLM's backends do.

        Rows may be dicts or rLLM ``Task`` objects; a row's ``data_source`` names its validation
        metrics (``val/<data_source>/pass@k``), as with rLLM's verl backend.
        """
        self.runtime.servers.check_alive()
        n = self.run.rollout_n_val if is_validation else self.run.rollout_n
        tasks, task_ids = rllm_api.task_ids(batch, n)
        with self.metrics.timed("generate") if not is_validation else nullcontext():
            episodes = await agent_workflow_engine.execute_tasks(
                tasks, task_ids, is_validation=is_validation, **kwargs
            )
        self.runtime.servers.check_alive()  # a server that died mid-rollout failed those rollouts
        for episode, task in zip(episodes, tasks, strict=True):
            source = rllm_api.task_field(task, "data_source")
            if source is not None and episode is not None:
                episode.metadata["data_source"] = source
        if not is_validation:
            tokens = sum(len(s.response_ids or []) for e in episodes for t in e.trajectories for s in t.steps)
            self.metrics.add({"perf/rollout_tokens": float(tokens)})
        return episodes

    # ------------------------------------------------------------------ training

    def transform_to_backend_batch(self, trainer_state: Any, **_):
        """Tokens the workflow dropped restored, advantages per group, trajectories -> rows."""
        run = self.run
        groups = list(trainer_state.trajectory_groups)
        with self.metrics.timed("transform"):
            restored, unmatched = restore_step_tokens(groups, self.rollout_engine.ledger)
            self.metrics.add(
                {"batch/steps_restored_from_rollouts": restored, "batch/steps_without_tokens": unmatched}
            )
            advantages = adv.batch_advantages(groups, run, self._algorithm_config)
            self.metrics.add(advantages.metrics)
            by_group = advantages.by_group
            if run.filter_zero_variance_groups and not run.uses_critic:
                keep = [i for i, flat in enumerate(adv.zero_variance(groups, advantages)) if not flat]
                self.metrics.add({"batch/filtered_zero_variance_groups": len(groups) - len(keep)})
                groups = [groups[i] for i in keep]
                by_group = None if by_group is None else [by_group[i] for i in keep]
            config = BatchConfig(
                pad_token_id=self.tokenizer.pad_token_id,
                dp_size=self.runtime.workers.dp_size("policy"),
                max_seq_len=run.max_prompt_length + run.max_response_length,
                vocab_size=len(self.tokenizer),
                drop_malformed=run.drop_malformed,
                use_precomputed_advantages=advantages.on_steps,
            )
            try:
                batch, stats = trajectory_groups_to_batch(groups, config, by_group)
            except EmptyBatchError as error:
                logger.warning("step %s: %s; skipping the update", trainer_state.global_step, error)
                self.metrics.add({"batch/skipped_update": 1.0})
                return _EMPTY
        self.metrics.add(stats.metrics())
        return batch

    async def process_backend_batch(self, trainer_state: Any, **_) -> None:
        batch = trainer_state.backend_batch
        if batch is not _EMPTY:
            await asyncio.to_thread(self._process, batch)

    def _process(self, batch: Any) -> None:
        run, workers = self.run, self.runtime.workers
        algo = run.skyrl.trainer.algorithm
        if run.uses_critic:
            with self.metrics.timed("critic_forward"):
                values_BT = stack_rows(workers.forward("critic", batch).loss_fn_outputs, "values")
            adv.add_gae_advantages(batch, values_BT, gamma=algo.gamma, lambd=algo.lambd)
        if not run.bypass_mode:
            with self.metrics.timed("old_logprobs"):
                outputs = workers.forward("policy", batch).loss_fn_outputs
            batch["action_log_probs"] = stack_rows(outputs, "logprobs")
        if run.uses_ref:
            with self.metrics.timed("ref_forward"):
                outputs = workers.forward("ref", batch).loss_fn_outputs
            batch["base_action_log_probs"] = stack_rows(outputs, "logprobs")
        boundaries = self._update.boundaries(batch)
        adv.apply_loss_reduction(
            batch,
            run.loss_reduction,
            mini_batch_boundaries=boundaries,
            max_seq_len=batch["loss_mask"].shape[1],
            scale=1.0 / run.async_chunks,  # a step's chunks each carry their share of its mean
        )
        self._update.accumulate(batch, boundaries)
        self._updated = True

    async def compute_advantages(self, trainer_state: Any, algorithm_config: Any = None, **_) -> None:
        """Advantages were computed before the forward-backward needed them (see transform)."""

    async def update_policy(self, trainer_state: Any, **_) -> None:
        if self._updated:
            await asyncio.to_thread(self._update.optim_step)

    # ------------------------------------------------------------------ hooks

    async def on_train_start(self, trainer_state: Any) -> None:
        """Resume (weights, optimizer, data position, RNG) and put the resumed policy on the servers
        (a LoRA policy's adapter always: the servers serve it under its adapter name only once loaded).

        With ``inference.deterministic_sampling`` every request is seeded (see ``SkyRLEngine``), so
        a resumed run samples exactly what an uninterrupted one would have.
        """
        self._outer_error = sys.exc_info()[1]  # an exception fit() itself runs inside is not ours
        self.metrics.clear()
        if self.run.inference.deterministic_sampling:
            self.rollout_engine.request_seed = self.run.seed
        resume = self.run.checkpoint
        resumed = await asyncio.to_thread(
            self.checkpoints.resume,
            mode=resume.resume_mode,
            path=resume.resume_from_path,
            trainer_state=trainer_state,
            workers=self.runtime.workers,
        )
        self._last_trained_step = self.resumed_step = resumed
        if resumed is not None or self.run.lora.enabled:  # a LoRA policy is served once it is synced
            await self._sync_weights(version=resumed or 0)
        # What is alive now (torch, transformers, Ray, the run's own state) lives for the whole run.
        # Frozen, it is no longer walked by every full collection, which otherwise took a large share
        # of the quickstart's training (bench/README.md: 'A step'). Collected first, so no garbage
        # is frozen with it.
        gc.collect()
        gc.freeze()

    async def on_epoch_start(self, trainer_state: Any) -> None:
        pass

    async def on_epoch_end(self, trainer_state: Any) -> None:
        pass

    async def on_batch_start(self, trainer_state: Any) -> None:
        # In fully-async mode this runs once per chunk: the step's state resets in on_batch_end.
        if self.runtime is not None:
            self.runtime.mark_first_step()

    async def on_batch_end(self, trainer_state: Any) -> None:
        """While a failed step's exception propagates nothing is published or saved: the run stops,
        and a resume continues from the last complete checkpoint."""
        step = trainer_state.global_step
        if not self._failing():
            if self._updated and not self.run.async_training:  # fully-async: on_policy_updated syncs
                with self.metrics.timed("weight_sync"):
                    await self._sync_weights(version=step)
            self._last_trained_step = step  # completed, updated or (empty batch) skipped
            save_freq = self.run.checkpoint.save_freq
            if save_freq > 0 and step % save_freq == 0:
                with self.metrics.timed("save_checkpoint"):
                    await asyncio.to_thread(self.checkpoints.save, step, trainer_state, self.runtime.workers)
        trainer_state.metrics.update(self.metrics.publish_step(trainer_state))
        if self.runtime is not None:
            trainer_state.metrics.update(self.runtime.startup_metrics())  # once, on the first step
        self.metrics.clear()
        self._updated = False

    async def on_policy_updated(self, trainer_state: Any) -> None:
        """Fully-async mode: the update happened in update_policy; publish it as the trainer's version."""
        with self.metrics.timed("weight_sync"):
            await self._sync_weights(version=trainer_state.weight_version)

    async def on_validation_start(self, trainer_state: Any) -> bool:
        trainer_state.is_training = False
        return True

    async def on_validation_end(self, trainer_state: Any) -> None:
        trainer_state.is_training = True
        if self.rollout_engine is not None:  # rLLM's async loop never resets it for training rollouts
            self.rollout_engine.is_validation = False

    async def on_train_end(self, trainer_state: Any) -> None:
        """Checkpoint the last step (unless save_freq just did) and close the HTTP clients.

        After a failure nothing is saved (the workers may be gone, the step half done); the log
        says which checkpoint a rerun with ``training.resume_mode=auto`` continues from.
        """
        if self.rollout_engine is not None:
            await self.rollout_engine.close()
        if self._failing():
            logger.error(failure_report(sys.exc_info()[1], trainer_state.global_step, self.checkpoints))
            return
        step = self._last_trained_step
        if self.checkpoints is None or step is None or self.run.checkpoint.save_freq <= 0:
            return  # save_freq <= 0: no checkpoints at all (rLLM's scripts pass -1 for that)
        if self.checkpoints.latest_step() != step:
            await asyncio.to_thread(self.checkpoints.save, step, trainer_state, self.runtime.workers)

    def _failing(self) -> bool:
        """True while an exception raised inside fit() propagates through a hook."""
        error = sys.exc_info()[1]
        return error is not None and error is not getattr(self, "_outer_error", None)

    async def _sync_weights(self, version: int) -> None:
        shipped = await self.runtime.sync_weights(version)
        if shipped is not None:
            self.metrics.add({"perf/weight_sync_bytes": shipped})
        await self.rollout_engine.publish_weight_version(version)

    def shutdown(self) -> None:
        """Stop what ``Runtime.start`` started, release the checkpoint directory; safe to call twice."""
        runtime, self.runtime = self.runtime, None
        SkyRLBackend._running.discard(self)
        if runtime is not None:
            runtime.shutdown()


class _EmptyBatch:
    """Marker for a step whose every trajectory was dropped: the update is skipped, not failed."""

    batch_size = 0


_EMPTY = _EmptyBatch()
