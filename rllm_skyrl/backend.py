"""``SkyRLBackend``: rLLM's ``BackendProtocol`` on SkyRL's trainers, workers and inference protocol.

The trainer owns the loop; this class fills in its stages (see ``trainer/protocol.py`` for the
order). One training step reads as the algorithm:

    generate_episodes          workflows sample from the inference servers
    transform_to_backend_batch advantages per trajectory group, episodes -> TrainingInputBatch
    process_backend_batch      critic values + GAE (PPO), loss reduction, forward_backward
    update_policy              optimizer step(s)
    on_batch_end               weight sync to the servers, checkpoint

Several mini-batches per step (``training.num_minibatches``) or PPO epochs interleave
forward_backward and optim_step inside ``process_backend_batch``; the step's last optimizer step
always lands in ``update_policy``, so gradients of one ``process_backend_batch`` accumulate until
then, as rLLM's fully-async mode expects.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rllm_skyrl import advantages as adv
from rllm_skyrl import weight_sync
from rllm_skyrl.backend_config import as_dict, check_config
from rllm_skyrl.checkpoint import CheckpointManager
from rllm_skyrl.data_adapter import BatchConfig, EmptyBatchError, trajectory_groups_to_batch
from rllm_skyrl.metrics import logprob_gap_metrics, worker_metrics
from rllm_skyrl.models import ModelRegistry

logger = logging.getLogger(__name__)


@contextmanager
def _timed(metrics: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[f"time/{name}"] = metrics.get(f"time/{name}", 0.0) + time.perf_counter() - start


def _select(cfg: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(cfg, key, default=default)


def resolve_model_path(path: str) -> str:
    """``tiny``: the in-process tiny test model; ``smollm2``: SmolLM2-135M-Instruct from its PyPI
    wheel (no hub); anything else is used as given."""
    if path == "tiny":
        from rllm_skyrl.tiny_model import build_tiny_model

        return str(build_tiny_model())
    if path == "smollm2":
        from rllm_skyrl.smollm2 import smollm2_path

        return str(smollm2_path())
    return path


class SkyRLBackend:
    """Trains with SkyRL's FSDP workers; serves rollouts through SkyRL's inference protocol.

    Reads only attributes that rLLM's own episode/trajectory/step objects have, so it runs under
    rLLM's ``UnifiedTrainer`` as well as under ``rllm_skyrl.trainer.UnifiedTrainer``.
    """

    name = "skyrl"
    requires_loop = False

    def __init__(self, config: DictConfig, cli_overrides: list[str] | None = None, **_: Any) -> None:
        self.config = config
        self.cli_overrides = list(cli_overrides or [])
        self.rollout_engine = None
        self.tokenizer = None
        self.skyrl_cfg = None
        self.workers = None
        self.models: ModelRegistry | None = None  # model ids "policy" / "critic" over self.workers
        self.servers = None
        self.checkpoints: CheckpointManager | None = None
        self._owns_ray = False
        self._step_metrics: dict[str, float] = {}
        self._updated = False
        self._last_trained_step: int | None = None

    # ------------------------------------------------------------------ set-up

    def _get(self, key: str, default: Any = None) -> Any:
        return _select(self.config, key, default)

    def validate_config(self) -> None:
        """Every check that needs no Ray, no model and no server; errors name the key to change."""
        checked = check_config(self.config, self.cli_overrides)
        self.skyrl_cfg = checked.skyrl_cfg
        self.policy_loss = checked.policy_loss
        self.critic_loss = checked.critic_loss
        self.loss_reduction = checked.loss_reduction

    @property
    def uses_critic(self) -> bool:
        return self._get("rllm.algorithm.adv_estimator", "grpo") == "gae"

    def _optimizer_steps(self, total_training_steps: int) -> int:
        trainer = self.skyrl_cfg.trainer
        per_batch = (
            trainer.train_batch_size // trainer.policy_mini_batch_size * trainer.update_epochs_per_batch
        )
        return max(total_training_steps, 1) * per_batch

    def _apply_warmup(self, optimizer_steps: int) -> None:
        """rLLM counts warmup in optimizer steps, or as a ratio of them when warmup_steps <= 0."""
        warmup = self._get("rllm.algorithm.warmup_steps", -1) or -1
        if warmup <= 0:
            warmup = int(self._get("rllm.algorithm.warmup_steps_ratio", 0.0) * optimizer_steps)
        for role in ("policy", "critic"):
            getattr(self.skyrl_cfg.trainer, role).optimizer_config.num_warmup_steps = max(warmup, 0)

    def init_rollout_engine(self, **kwargs: Any):
        """Start Ray, the training workers and the inference servers; return the rollout engine."""
        from transformers import AutoTokenizer

        from rllm_skyrl.engine import SkyRLEngine
        from rllm_skyrl.launcher import start_ray
        from rllm_skyrl.workers import SkyRLWorkers

        trainer_cfg = self.skyrl_cfg.trainer
        model_path = resolve_model_path(trainer_cfg.policy.model.path)
        trainer_cfg.policy.model.path = model_path
        trainer_cfg.ref.model.path = resolve_model_path(trainer_cfg.ref.model.path or model_path)
        if self.uses_critic:
            trainer_cfg.critic.model.path = resolve_model_path(trainer_cfg.critic.model.path or model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if self.tokenizer.pad_token_id is None:  # rows are left-padded; any id works, masks hide it
            logger.warning(
                "tokenizer of %s has no pad token; padding with eos %r", model_path, self.tokenizer.eos_token
            )
            self.tokenizer.pad_token = self.tokenizer.eos_token

        total_steps = kwargs.get("total_training_steps") or 1
        optimizer_steps = self._optimizer_steps(total_steps)
        self._apply_warmup(optimizer_steps)
        self.run_dir = Path(trainer_cfg.ckpt_path)
        try:  # a failure part-way must not leave Ray, workers or servers behind
            self._owns_ray = start_ray(self.skyrl_cfg, log_dir=trainer_cfg.log_path)
            self.workers = SkyRLWorkers(self.skyrl_cfg, self.tokenizer, total_training_steps=optimizer_steps)
            self.models = ModelRegistry(self.workers)
            self.models.create_model("policy")
            if self.uses_critic:
                self.models.create_model("critic", model_role="critic")

            self.servers = self._start_servers(model_path, trainer_cfg)
            engine_args = dict(
                max_prompt_length=int(self._get("rllm.data.max_prompt_length")),
                max_response_length=int(self._get("rllm.data.max_response_length")),
                train_sampling_params=_sampling(self._get("rllm.rollout.train")),
                val_sampling_params=_sampling(self._get("rllm.rollout.val")),
            )
            if getattr(self.servers, "client", None) is not None:  # SkyRL built the client with its servers
                self.rollout_engine = SkyRLEngine(self.servers.client, self.tokenizer, **engine_args)
            else:
                self.rollout_engine = SkyRLEngine.from_urls(self.servers.urls, self.tokenizer, **engine_args)
            weight_sync.prepare(self.workers, self.rollout_engine)
            self.checkpoints = CheckpointManager(
                root=trainer_cfg.ckpt_path,
                workers=self.workers,
                max_to_keep=int(self._get("training.max_ckpts_to_keep", -1)),
            )
        except BaseException:
            self.shutdown()
            raise
        return self.rollout_engine

    def _start_servers(self, model_path: str, trainer_cfg: Any):
        """Given URLs, else SkyRL's vLLM servers on CUDA, else our transformers servers on CPU."""
        from rllm_skyrl.compat import cpu
        from rllm_skyrl.servers import external_servers, start_cpu_servers, start_skyrl_servers

        urls = self._get("inference.urls")
        if urls:
            return external_servers(list(urls))
        if cpu.cuda_available():
            return start_skyrl_servers(self.skyrl_cfg, self.tokenizer)
        return start_cpu_servers(
            model_path,
            int(self._get("inference.num_engines", 1)),
            log_dir=Path(trainer_cfg.log_path) / "inference",
            max_model_len=self._get("inference.max_model_len"),
            max_batch_size=int(self._get("inference.max_batch_size", 256)),
            seed=trainer_cfg.seed,
        )

    # ------------------------------------------------------------------ rollouts

    async def generate_episodes(
        self, batch: Any, agent_workflow_engine: Any, is_validation: bool = False, **_
    ):
        """Roll out each task n (or n_val) times under one task id, as rLLM's backends do."""
        n = self._get("rllm.rollout.n_val" if is_validation else "rllm.rollout.n", 1)
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
        metrics = self._step_metrics
        groups = list(trainer_state.trajectory_groups)
        outcome = None
        precomputed = bool(self._get("rllm.algorithm.use_precomputed_advantage", False))
        with _timed(metrics, "transform"):
            if not self.uses_critic and not precomputed:
                outcome = adv.compute_group_advantages(
                    groups,
                    self._get("rllm.algorithm.adv_estimator", "grpo"),
                    estimator_map=self._get("rllm.algorithm.estimator_map"),
                    norm_by_std=bool(self._get("rllm.algorithm.norm_adv_by_std_in_grpo", True)),
                )
                self._advantage_metrics = dict(outcome.metrics)
                if self._get("training.filter_zero_variance_groups", False):
                    keep = [i for i, a in enumerate(outcome.advantages_by_group) if a.abs().max() > 1e-8]
                    metrics["batch/filtered_zero_variance_groups"] = float(len(groups) - len(keep))
                    groups = [groups[i] for i in keep]
                    outcome.advantages_by_group = [outcome.advantages_by_group[i] for i in keep]
            config = BatchConfig(
                pad_token_id=self.tokenizer.pad_token_id,
                dp_size=self.workers.dp_size("policy"),
                max_seq_len=self._get("rllm.data.max_prompt_length")
                + self._get("rllm.data.max_response_length"),
                vocab_size=len(self.tokenizer),
                drop_malformed=bool(self._get("training.drop_malformed", False)),
                use_precomputed_advantages=precomputed,
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
        """Critic values and GAE (PPO), loss reduction, then forward_backward on every mini-batch."""
        batch = trainer_state.backend_batch
        if batch is _EMPTY:
            return
        metrics = self._step_metrics
        algo = self.skyrl_cfg.trainer.algorithm
        if self.uses_critic:
            with _timed(metrics, "critic_forward"):
                values = self.workers.forward("critic", batch).loss_fn_outputs
            adv.add_gae_advantages(batch, _stack(values, "values"), gamma=algo.gamma, lambd=algo.lambd)
        if not self._get("rllm.algorithm.rollout_correction.bypass_mode", True):
            with _timed(metrics, "old_logprobs"):
                batch["action_log_probs"] = _stack(
                    self.workers.forward("policy", batch).loss_fn_outputs, "logprobs"
                )
        if algo.use_kl_loss:
            with _timed(metrics, "ref_forward"):
                batch["base_action_log_probs"] = _stack(
                    self.workers.forward("ref", batch).loss_fn_outputs, "logprobs"
                )
        boundaries = self._minibatch_boundaries(batch)
        adv.apply_loss_reduction(
            batch,
            self.loss_reduction,
            mini_batch_boundaries=boundaries,
            max_seq_len=batch["loss_mask"].shape[1],
        )
        self._train(batch, boundaries)

    def _minibatch_boundaries(self, batch) -> list[tuple[int, int]]:
        """Contiguous row ranges, one per optimizer step; each a multiple of the DP size."""
        dp = self.workers.dp_size("policy")
        real = batch.batch_size - batch.metadata.get("pad_size", 0)
        count = min(int(self._get("training.num_minibatches", 1)), max(real // dp, 1))
        size = math.ceil(real / count / dp) * dp
        return [(start, min(start + size, real)) for start in range(0, real, size)]

    def _train(self, batch, boundaries: list[tuple[int, int]]) -> None:
        """forward_backward per mini-batch; an optimizer step between them, the last one in update_policy."""
        metrics = self._step_metrics
        epochs = self.skyrl_cfg.trainer.update_epochs_per_batch
        plan = boundaries * epochs
        dp = self.workers.dp_size("policy")
        roles = ["policy"] + (["critic"] if self.uses_critic else [])
        losses = {
            "policy": (self.policy_loss.loss_fn, as_dict(self._get("training.loss_fn_config"))),
            "critic": (self.critic_loss.loss_fn, as_dict(self._get("training.critic_loss_fn_config"))),
        }
        for index, (start, end) in enumerate(plan):
            minibatch = _padded_slice(batch, start, end, dp)
            for role in roles:  # model ids are the role names
                loss_fn, loss_fn_config = losses[role]
                with _timed(metrics, "forward_backward" if role == "policy" else f"forward_backward_{role}"):
                    output = self.models.forward_backward(role, minibatch, loss_fn, loss_fn_config)
                metrics.update(worker_metrics(role, output.metrics))
                if role == "policy" and index == 0:
                    rows = [{"logprobs": row["logprobs"]["data"]} for row in output.loss_fn_outputs]
                    metrics.update(logprob_gap_metrics(minibatch, rows))
            if index < len(plan) - 1:
                self._optim_step(roles)
        self._updated = True

    def _optim_step(self, roles: list[str]) -> None:
        metrics = self._step_metrics
        with _timed(metrics, "optim_step"):
            for role in roles:
                grad_norm = self.models.optim_step(role)
                if grad_norm is not None:
                    prefix = "train" if role == "policy" else role
                    metrics[f"{prefix}/grad_norm"] = float(grad_norm)

    async def compute_advantages(self, trainer_state: Any, algorithm_config: Any = None, **_) -> None:
        """Advantages were computed before the forward-backward needed them; report them here."""
        trainer_state.metrics.update(getattr(self, "_advantage_metrics", {}))
        batch = trainer_state.backend_batch
        if batch is not _EMPTY and batch is not None and "advantages" in batch:
            mask = batch["loss_mask"] > 0
            if mask.any():
                values = batch["advantages"][mask]
                trainer_state.metrics["advantage/token_scaled/mean"] = values.mean().item()

    async def update_policy(self, trainer_state: Any, **_) -> None:
        if self._updated:
            self._optim_step(["policy"] + (["critic"] if self.uses_critic else []))

    # ------------------------------------------------------------------ hooks

    async def on_train_start(self, trainer_state: Any) -> None:
        """Resume (weights, optimizer, data position, RNG) and put the resumed policy on the servers.

        With ``inference.deterministic_sampling`` every request is seeded (see ``SkyRLEngine``), so
        a resumed run samples exactly what an uninterrupted one would have.
        """
        self._outer_error = sys.exc_info()[1]  # an exception fit() itself runs inside is not ours
        if self._get("inference.deterministic_sampling", False):
            self.rollout_engine.request_seed = int(self.skyrl_cfg.trainer.seed)
        resumed = self.checkpoints.resume(
            mode=self._get("training.resume_mode", "auto"),
            path=self._get("training.resume_from_path"),
            trainer_state=trainer_state,
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

        This hook also runs while a failed step's exception propagates (this package's driver calls
        it from ``finally``); then nothing is published or saved: the run stops, and a resume
        continues from the last complete checkpoint.
        """
        metrics = self._step_metrics
        step = trainer_state.global_step
        if not self._failing():
            if self._updated:
                with _timed(metrics, "weight_sync"):
                    await self._sync_weights(version=step)
            self._last_trained_step = step  # completed, updated or (empty batch) skipped
            save_freq = int(self._get("rllm.trainer.save_freq", 0) or 0)
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
            self._report_failure(trainer_state)
            return
        step = self._last_trained_step
        if self.checkpoints is None or step is None or not self._get("rllm.trainer.save_freq", 0):
            return
        if self.checkpoints.latest_step() != step:
            self.checkpoints.save(step, trainer_state)

    def _failing(self) -> bool:
        """True while an exception raised inside fit() propagates through a hook."""
        error = sys.exc_info()[1]
        return error is not None and error is not getattr(self, "_outer_error", None)

    def _report_failure(self, trainer_state: Any) -> None:
        import ray.exceptions

        error = sys.exc_info()[1]
        first_line = (str(error).strip().splitlines() or [""])[0]
        cause = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
        if isinstance(error, ray.exceptions.RayActorError):
            cause = f"a SkyRL training worker died ({cause})"
        try:
            latest = self.checkpoints.latest_step() if self.checkpoints is not None else None
        except RuntimeError:
            latest = None
        if latest is None:
            where = "no checkpoint was saved, so a rerun starts from step 1"
        else:
            where = (
                f"rerun with training.resume_mode=auto to continue after step {latest} "
                f"({self.checkpoints.step_dir(latest)})"
            )
        logger.error("training stopped at step %s: %s; %s", trainer_state.global_step, cause, where)

    async def _sync_weights(self, version: int) -> None:
        from rllm_skyrl.weight_sync import sync_weights

        await sync_weights(self.workers, self.servers, self.run_dir / "sync", version)
        self.rollout_engine.weight_version = version

    def shutdown(self) -> None:
        """Stop servers, then workers, then Ray if we started it; safe to call twice."""
        import ray

        if self.servers is not None:
            self.servers.stop()
            self.servers = None
        self.models = None
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False


class _EmptyBatch:
    """Marker for a step whose every trajectory was dropped: the update is skipped, not failed."""

    batch_size = 0


_EMPTY = _EmptyBatch()


def _sampling(section: Any) -> dict[str, Any]:
    return {key: value for key, value in (as_dict(section) or {}).items() if value is not None}


def _stack(outputs: list[dict[str, Any]], key: str) -> torch.Tensor:
    """Per-row worker outputs (already padded to the response window) -> ``[B, T]``."""
    return torch.stack([torch.as_tensor(o[key], dtype=torch.float32) for o in outputs])


def _padded_slice(batch, start: int, end: int, dp_size: int):
    """Rows [start, end) padded with zero-loss copies to a multiple of the DP size, metadata to match."""
    from skyrl.backends.skyrl_train.training_batch import pad_training_input_batch

    part = batch.slice(start, end)
    part.metadata = {
        **batch.metadata,
        "uids": batch.metadata["uids"][start:end],
        "row_ids": batch.metadata["row_ids"][start:end],
        "pad_size": 0,
    }
    pad = (-part.batch_size) % dp_size
    return pad_training_input_batch(part, pad) if pad else part
