"""``SkyRLBackend``: rLLM's ``BackendProtocol`` on SkyRL's trainers, workers and inference protocol.

The trainer owns the loop; this class fills in its stages (see ``standalone/protocol.py`` for the
order). One training step reads as the algorithm:

    generate_episodes          workflows sample from the inference servers
    transform_to_backend_batch advantages per trajectory group, episodes -> TrainingInputBatch
    process_backend_batch      critic values + GAE (PPO), loss reduction, forward_backward
    update_policy              optimizer step(s)
    on_batch_end               weight sync to the servers, checkpoint

Several mini-batches per step (``training.num_minibatches``) or PPO epochs interleave
forward_backward and optim_step inside ``process_backend_batch``; the step's last optimizer step
always lands in ``update_policy``, so gradients of one ``process_backend_batch`` accumulate until
then, as rLLM's fully-async mode expects. What is resolved from the config is in ``run_config``;
what is started and stopped is in ``runtime``.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig

from rllm_skyrl import advantages as adv
from rllm_skyrl.batch_layout import real_rows, row_slice, stack_rows
from rllm_skyrl.checkpoint import CheckpointManager, failure_report
from rllm_skyrl.data_adapter import BatchConfig, EmptyBatchError, trajectory_groups_to_batch
from rllm_skyrl.metrics import logprob_gap_metrics, worker_metrics
from rllm_skyrl.run_config import RunConfig, resolve_run_config
from rllm_skyrl.runtime import Runtime

logger = logging.getLogger(__name__)


@contextmanager
def _timed(metrics: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[f"time/{name}"] = metrics.get(f"time/{name}", 0.0) + time.perf_counter() - start


class SkyRLBackend:
    """Trains with SkyRL's FSDP workers; serves rollouts through SkyRL's inference protocol.

    Reads only attributes that rLLM's own episode/trajectory/step objects have, so it runs under
    rLLM's ``UnifiedTrainer`` as well as under ``rllm_skyrl.standalone.UnifiedTrainer``.
    """

    name = "skyrl"
    requires_loop = False

    def __init__(self, config: DictConfig, cli_overrides: list[str] | None = None, **_: Any) -> None:
        self.config = config
        self.cli_overrides = list(cli_overrides or [])
        self.run: RunConfig | None = None
        self.runtime: Runtime | None = None
        self.rollout_engine = None
        self.tokenizer = None
        self.checkpoints: CheckpointManager | None = None
        self._step_metrics: dict[str, float] = {}
        self._advantage_metrics: dict[str, float] = {}
        self._updated = False
        self._last_trained_step: int | None = None

    # ------------------------------------------------------------------ set-up

    def validate_config(self) -> None:
        """Every check that needs no Ray, no model and no server; errors name the key to change."""
        self.run = resolve_run_config(self.config, self.cli_overrides)

    def init_rollout_engine(self, **kwargs: Any):
        """Start Ray, the training workers and the inference servers; return the rollout engine."""
        from rllm_skyrl.engine import SkyRLEngine

        self.run = self.run.for_total_steps(kwargs.get("total_training_steps") or 1)
        try:  # a failure part-way must not leave Ray, workers or servers behind
            self.runtime = Runtime.start(self.run)
            self.tokenizer = self.runtime.tokenizer
            for role in self.run.trained_roles:  # model ids are the role names
                self.runtime.models.create_model(role, model_role=role)
            self.rollout_engine = SkyRLEngine.for_servers(self.runtime.servers, self.tokenizer, self.run)
            self.runtime.connect_weight_sync(self.rollout_engine.client)
            self.checkpoints = CheckpointManager(
                self.run.checkpoint.root, self.runtime.workers, self.run.checkpoint.max_to_keep
            )
        except BaseException:
            self.shutdown()
            raise
        return self.rollout_engine

    # ------------------------------------------------------------------ rollouts

    async def generate_episodes(
        self, batch: Any, agent_workflow_engine: Any, is_validation: bool = False, **_
    ):
        """Roll out each task n (or n_val) times under one task id, as rLLM's backends do."""
        n = self.run.rollout_n_val if is_validation else self.run.rollout_n
        tasks, task_ids = [], []
        for row in batch:
            task_id = str(row.get("uid") or row.get("id") or row.get("task_id") or len(task_ids))
            tasks.extend([row] * n)
            task_ids.extend([task_id] * n)
        if self.rollout_engine is not None:
            self.rollout_engine.is_validation = is_validation
        metrics = {} if is_validation else self._step_metrics
        with _timed(metrics, "generate"):
            episodes = await agent_workflow_engine.execute_tasks(tasks, task_ids, is_validation=is_validation)
        if not is_validation:
            tokens = sum(len(s.response_ids) for e in episodes for t in e.trajectories for s in t.steps)
            metrics["perf/rollout_tokens"] = float(tokens)
            metrics["perf/rollout_tokens_per_s"] = tokens / max(metrics["time/generate"], 1e-9)
        return episodes

    # ------------------------------------------------------------------ training

    def transform_to_backend_batch(self, trainer_state: Any, **_):
        """Advantages per trajectory group (outcome estimators), then trajectories -> rows."""
        run, metrics = self.run, self._step_metrics
        groups = list(trainer_state.trajectory_groups)
        outcome = None
        with _timed(metrics, "transform"):
            if not run.uses_critic and not run.use_precomputed_advantage:
                outcome = adv.compute_group_advantages(
                    groups, run.estimator, estimator_map=run.estimator_map, norm_by_std=run.norm_adv_by_std
                )
                self._advantage_metrics = dict(outcome.metrics)
                if run.filter_zero_variance_groups:
                    keep = [i for i, a in enumerate(outcome.advantages_by_group) if a.abs().max() > 1e-8]
                    metrics["batch/filtered_zero_variance_groups"] = float(len(groups) - len(keep))
                    groups = [groups[i] for i in keep]
                    outcome.advantages_by_group = [outcome.advantages_by_group[i] for i in keep]
            config = BatchConfig(
                pad_token_id=self.tokenizer.pad_token_id,
                dp_size=self.runtime.workers.dp_size("policy"),
                max_seq_len=run.max_prompt_length + run.max_response_length,
                vocab_size=len(self.tokenizer),
                drop_malformed=run.drop_malformed,
                use_precomputed_advantages=run.use_precomputed_advantage,
            )
            advantages = [a.tolist() for a in outcome.advantages_by_group] if outcome is not None else None
            try:
                batch, stats = trajectory_groups_to_batch(groups, config, advantages)
            except EmptyBatchError as error:
                logger.warning("step %s: %s; skipping the update", trainer_state.global_step, error)
                metrics["batch/skipped_update"] = 1.0
                return _EMPTY
        metrics.update(stats.metrics())
        return batch

    async def process_backend_batch(self, trainer_state: Any, **_) -> None:
        """Critic values and GAE (PPO), old/reference logprobs, loss reduction, forward_backward."""
        batch = trainer_state.backend_batch
        if batch is _EMPTY:
            return
        run, metrics, workers = self.run, self._step_metrics, self.runtime.workers
        algo = run.skyrl.trainer.algorithm
        if run.uses_critic:
            with _timed(metrics, "critic_forward"):
                values_BT = stack_rows(workers.forward("critic", batch).loss_fn_outputs, "values")
            adv.add_gae_advantages(batch, values_BT, gamma=algo.gamma, lambd=algo.lambd)
        if not run.bypass_mode:
            with _timed(metrics, "old_logprobs"):
                batch["action_log_probs"] = stack_rows(
                    workers.forward("policy", batch).loss_fn_outputs, "logprobs"
                )
        if run.uses_ref:
            with _timed(metrics, "ref_forward"):
                batch["base_action_log_probs"] = stack_rows(
                    workers.forward("ref", batch).loss_fn_outputs, "logprobs"
                )
        boundaries = self._minibatch_boundaries(batch)
        adv.apply_loss_reduction(
            batch,
            run.loss_reduction,
            mini_batch_boundaries=boundaries,
            max_seq_len=batch["loss_mask"].shape[1],
        )
        self._train(batch, boundaries)

    def _minibatch_boundaries(self, batch) -> list[tuple[int, int]]:
        """Contiguous row ranges, one per optimizer step; each a multiple of the DP size."""
        dp = self.runtime.workers.dp_size("policy")
        real = real_rows(batch)
        count = min(self.run.num_minibatches, max(real // dp, 1))
        size = math.ceil(real / count / dp) * dp
        return [(start, min(start + size, real)) for start in range(0, real, size)]

    def _train(self, batch, boundaries: list[tuple[int, int]]) -> None:
        """forward_backward per mini-batch; an optimizer step between them, the last one in update_policy."""
        run, metrics = self.run, self._step_metrics
        plan = boundaries * run.update_epochs
        dp = self.runtime.workers.dp_size("policy")
        losses = {"policy": run.policy_loss, "critic": run.critic_loss}
        for index, (start, end) in enumerate(plan):
            minibatch = row_slice(batch, start, end, dp)
            for role in run.trained_roles:
                with _timed(metrics, "forward_backward" if role == "policy" else f"forward_backward_{role}"):
                    output = self.runtime.models.forward_backward(role, minibatch, losses[role])
                metrics.update(worker_metrics(role, output.metrics))
                if role == "policy" and index == 0:
                    rows = [{"logprobs": row["logprobs"]["data"]} for row in output.loss_fn_outputs]
                    metrics.update(logprob_gap_metrics(minibatch, rows))
            if index < len(plan) - 1:
                self._optim_step()
        self._updated = True

    def _optim_step(self) -> None:
        with _timed(self._step_metrics, "optim_step"):
            for role in self.run.trained_roles:
                grad_norm = self.runtime.models.optim_step(role)
                if grad_norm is not None:
                    prefix = "train" if role == "policy" else role
                    self._step_metrics[f"{prefix}/grad_norm"] = float(grad_norm)

    async def compute_advantages(self, trainer_state: Any, algorithm_config: Any = None, **_) -> None:
        """Advantages were computed before the forward-backward needed them; report them here."""
        trainer_state.metrics.update(self._advantage_metrics)
        batch = trainer_state.backend_batch
        if batch is not _EMPTY and batch is not None and "advantages" in batch:
            mask = batch["loss_mask"] > 0
            if mask.any():
                trainer_state.metrics["advantage/token_scaled/mean"] = batch["advantages"][mask].mean().item()

    async def update_policy(self, trainer_state: Any, **_) -> None:
        if self._updated:
            self._optim_step()

    # ------------------------------------------------------------------ hooks

    async def on_train_start(self, trainer_state: Any) -> None:
        """Resume (weights, optimizer, data position, RNG) and put the resumed policy on the servers.

        With ``inference.deterministic_sampling`` every request is seeded (see ``SkyRLEngine``), so
        a resumed run samples exactly what an uninterrupted one would have.
        """
        self._outer_error = sys.exc_info()[1]  # an exception fit() itself runs inside is not ours
        if self.run.inference.deterministic_sampling:
            self.rollout_engine.request_seed = self.run.seed
        resume = self.run.checkpoint
        resumed = self.checkpoints.resume(
            mode=resume.resume_mode, path=resume.resume_from_path, trainer_state=trainer_state
        )
        self._last_trained_step = resumed
        if resumed is not None:
            await self._sync_weights(version=resumed)

    async def on_epoch_start(self, trainer_state: Any) -> None:
        pass

    async def on_epoch_end(self, trainer_state: Any) -> None:
        pass

    async def on_batch_start(self, trainer_state: Any) -> None:
        self._step_metrics = {}
        self._advantage_metrics = {}
        self._updated = False

    async def on_batch_end(self, trainer_state: Any) -> None:
        """Weight sync after an update, then a checkpoint every ``rllm.trainer.save_freq`` steps.

        This hook also runs while a failed step's exception propagates (the standalone trainer
        calls it from ``finally``); then nothing is published or saved: the run stops, and a
        resume continues from the last complete checkpoint.
        """
        metrics = self._step_metrics
        step = trainer_state.global_step
        if not self._failing():
            if self._updated:
                with _timed(metrics, "weight_sync"):
                    await self._sync_weights(version=step)
            self._last_trained_step = step  # completed, updated or (empty batch) skipped
            save_freq = self.run.checkpoint.save_freq
            if save_freq > 0 and step % save_freq == 0:
                with _timed(metrics, "save_checkpoint"):
                    self.checkpoints.save(step, trainer_state)
        trainer_state.metrics.update(metrics)

    async def on_policy_updated(self, trainer_state: Any) -> None:
        """Fully-async mode: the update happened in update_policy; publish the new weights."""
        await self._sync_weights(version=trainer_state.global_step)

    async def on_validation_start(self, trainer_state: Any) -> bool:
        trainer_state.is_training = False
        return True

    async def on_validation_end(self, trainer_state: Any) -> None:
        trainer_state.is_training = True
        if self.rollout_engine is not None:
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
        if self.checkpoints is None or step is None or not self.run.checkpoint.save_freq:
            return
        if self.checkpoints.latest_step() != step:
            self.checkpoints.save(step, trainer_state)

    def _failing(self) -> bool:
        """True while an exception raised inside fit() propagates through a hook."""
        error = sys.exc_info()[1]
        return error is not None and error is not getattr(self, "_outer_error", None)

    async def _sync_weights(self, version: int) -> None:
        await self.runtime.sync_weights(version)
        self.rollout_engine.weight_version = version

    def shutdown(self) -> None:
        """Stop servers, workers and Ray (if this run started it); safe to call twice."""
        runtime, self.runtime = self.runtime, None
        if runtime is not None:
            runtime.shutdown()


class _EmptyBatch:
    """Marker for a step whose every trajectory was dropped: the update is skipped, not failed."""

    batch_size = 0


_EMPTY = _EmptyBatch()
