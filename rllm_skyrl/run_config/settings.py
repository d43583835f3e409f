"""The resolved run: the typed, immutable settings everything downstream reads."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rllm_skyrl.errors import UserFacingError
from rllm_skyrl.hardware import Platform
from rllm_skyrl.run_config import losses
from rllm_skyrl.run_config.algorithm import OffPolicySettings, default_policy_loss
from rllm_skyrl.run_config.lora import LoraSettings


class ConfigError(UserFacingError):
    """A setting that cannot work; the message names the key, the value and what is allowed."""


@dataclass(frozen=True)
class InferenceSettings:
    """Where rollouts are served (``inference.*``)."""

    urls: tuple[str, ...] = ()
    num_engines: int = 1
    max_model_len: int | None = None
    max_batch_size: int = 256
    deterministic_sampling: bool = False
    threads: int = 1  # torch threads of each CPU server


@dataclass(frozen=True)
class RolloutSettings:
    """How prompts are rendered and answers parsed (``rollout_engine.*``, ``rllm.disable_thinking``)."""

    disable_thinking: bool = False
    render_with_parser: bool = False
    reasoning_effort: str | None = None


@dataclass(frozen=True)
class CheckpointSettings:
    """Where checkpoints go and how a run resumes (``training.*`` and ``rllm.trainer.save_freq``)."""

    root: Path
    save_freq: int = 0
    resume_mode: str = "auto"
    resume_from_path: str | None = None
    max_to_keep: int = -1


@dataclass(frozen=True)
class RunConfig:
    """One run, resolved. ``skyrl`` is SkyRL's typed config: read it, never assign to it."""

    platform: Platform
    skyrl: Any
    model_path: str
    roles: tuple[str, ...]
    estimator: str
    estimator_map: Mapping[str, str]
    norm_adv_by_std: bool
    use_precomputed_advantage: bool
    filter_zero_variance_groups: bool
    policy_loss: losses.ResolvedLoss
    critic_loss: losses.ResolvedLoss
    role_losses: Mapping[str, losses.ResolvedLoss]
    loss_reduction: str
    bypass_mode: bool  # the loss's old log-probs are the sampler's (no forward pass before the update)
    drop_malformed: bool
    rollout_n: int
    rollout_n_val: int
    max_prompt_length: int
    max_response_length: int
    train_sampling: Mapping[str, Any]
    val_sampling: Mapping[str, Any]
    inference: InferenceSettings
    checkpoint: CheckpointSettings
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    off_policy: OffPolicySettings = field(default_factory=OffPolicySettings)
    async_training: bool = False
    async_chunks: int = 1  # fully-async: forward-backward calls that make up one optimizer step
    cpu_threads: int = 1  # torch threads of each training worker on CPU
    warmup_steps_ratio: float = 0.0
    optimizer_steps: int | None = None  # known once the trainer says how many steps it runs
    loss_fn: str | None = None  # rllm.algorithm.loss_fn as set (None: each estimator's default)
    loss_fn_config: Mapping[str, Any] | None = None  # training.loss_fn_config

    def loss_for(self, role: str) -> losses.ResolvedLoss:
        """The policy loss rows of trajectory role ``role`` train with."""
        return self.role_losses.get(role, self.policy_loss)

    def with_algorithm_config(self, algorithm_config: Any) -> RunConfig:
        """A copy with the per-role estimators and losses rLLM users set in code (the trainer's
        ``AlgorithmConfig``), each loss checked against the off-policy correction as configured ones are."""
        estimator_map = {
            role: getattr(value, "value", value)
            for role, value in (getattr(algorithm_config, "estimator_map", None) or {}).items()
        }
        loss_fn_map = dict(getattr(algorithm_config, "loss_fn_map", None) or {})
        role_losses = dict(self.role_losses)
        for role in set(estimator_map) | set(loss_fn_map):
            estimator = estimator_map.get(role, self.estimator)
            name = loss_fn_map.get(role) or self.loss_fn or default_policy_loss(estimator)
            try:
                resolved = losses.resolve_loss("policy", name, self.loss_fn_config)
            except ValueError as error:
                raise ConfigError(f"loss for trajectory role {role!r} ({name!r}): {error}") from error
            who = f"the loss of trajectory role {role!r} ({name!r})"
            try:
                role_losses[role] = self.off_policy.loss(resolved, who)
            except ValueError as error:
                raise ConfigError(str(error)) from error
        return dataclasses.replace(
            self, estimator_map={**self.estimator_map, **estimator_map}, role_losses=role_losses
        )

    @property
    def uses_critic(self) -> bool:
        return "critic" in self.roles

    @property
    def uses_ref(self) -> bool:
        return "ref" in self.roles

    @property
    def trained_roles(self) -> tuple[str, ...]:
        """Roles with an optimizer (the reference model never changes)."""
        return tuple(role for role in self.roles if role != "ref")

    @property
    def seed(self) -> int:
        return int(self.skyrl.trainer.seed)

    @property
    def log_dir(self) -> Path:
        return Path(self.skyrl.trainer.log_path)

    @property
    def sync_dir(self) -> Path:
        """Where the trainer writes weights for the servers to load; the servers load nothing else."""
        return Path(self.checkpoint.root) / "sync"

    @property
    def num_minibatches(self) -> int:
        trainer = self.skyrl.trainer
        return trainer.train_batch_size // trainer.policy_mini_batch_size

    @property
    def update_epochs(self) -> int:
        return int(self.skyrl.trainer.update_epochs_per_batch)

    def for_total_steps(self, total_training_steps: int) -> RunConfig:
        """A copy that knows the run's optimizer steps, and the warmup when it is a ratio of them
        (``rllm.algorithm.warmup_steps`` <= 0); rLLM and SkyRL's schedulers count optimizer steps."""
        optimizer_steps = max(int(total_training_steps or 1), 1) * self.num_minibatches * self.update_epochs
        skyrl_cfg = copy.deepcopy(self.skyrl)
        for role in ("policy", "critic"):
            optimizer = getattr(skyrl_cfg.trainer, role).optimizer_config
            if optimizer.num_warmup_steps is None or optimizer.num_warmup_steps <= 0:
                optimizer.num_warmup_steps = max(int(self.warmup_steps_ratio * optimizer_steps), 0)
        return dataclasses.replace(self, skyrl=skyrl_cfg, optimizer_steps=optimizer_steps)
