"""The composed Hydra config -> one typed, fully resolved, immutable ``RunConfig``.

Everything downstream (backend, runtime, launcher, examples) reads this object and nothing
rewrites it: model names are resolved to directories, losses are resolved once per role, the
roles that get workers are decided here, and so is SkyRL's typed config. The number of training
steps is only known when the trainer starts, so ``for_total_steps`` returns a copy with the
optimizer-step count and the warmup that depends on it.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm_skyrl import losses
from rllm_skyrl.errors import UserFacingError
from rllm_skyrl.hardware import Platform
from rllm_skyrl.run_config import bridge
from rllm_skyrl.run_config.aliases import apply_aliases
from rllm_skyrl.run_config.lora import LoraSettings, resolve_lora
from rllm_skyrl.run_config.skyrl import make_skyrl_config
from rllm_skyrl.run_config.tree import select
from rllm_skyrl.run_config.values import check_values

# rLLM's outcome estimators (``advantages``); GAE is SkyRL's and needs a critic.
OUTCOME_ESTIMATORS = ("grpo", "rloo", "reinforce", "reinforce_plus_plus_baseline", "prpo")
SUPPORTED_ESTIMATORS = (*OUTCOME_ESTIMATORS, "gae")
RESUME_MODES = ("auto", "disable", "resume_path")  # ``training.resume_mode`` (``checkpoint``)

# Our names (rLLM/verl spellings, with "-" or "_") -> (SkyRL reduction, fixed length constant or None).
# seq_mean_token_sum is Dr. GRPO's seq_mean_token_sum_norm with a constant of 1: sum per sequence,
# mean over sequences.
SKYRL_LOSS_REDUCTIONS: dict[str, tuple[str, int | None]] = {
    "token_mean": ("token_mean", None),
    "sequence_mean": ("sequence_mean", None),
    "seq_mean_token_mean": ("sequence_mean", None),
    "seq_mean_token_sum": ("seq_mean_token_sum_norm", 1),
    "seq_mean_token_sum_norm": ("seq_mean_token_sum_norm", None),
    "prompt_mean": ("prompt_mean", None),
}
# The policy loss when rllm.algorithm.loss_fn names none, as rLLM's tinker backend picks it.
_LOSS_BY_ESTIMATOR = {"grpo": "ppo", "gae": "ppo"}


def default_policy_loss(estimator: str) -> str:
    """``ppo`` for GRPO (and GAE), ``importance_sampling`` for the other estimators (rLLM's rule)."""
    return _LOSS_BY_ESTIMATOR.get(estimator, "importance_sampling")


# Model names that need no hub: built in-process, or converted from a PyPI wheel.
BUILTIN_MODELS = ("tiny", "smollm2")


class ConfigError(UserFacingError):
    """A setting that cannot work; the message names the key, the value and what is allowed."""


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


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_path(key: str, path: Any) -> None:
    """A model this machine can load: a built-in name, an HF model directory, or a hub id."""
    if path is None or path in BUILTIN_MODELS:
        return
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(
            f"{key}={path!r}: expected an HF model directory, a hub id (org/name), or tiny/smollm2"
        )
    directory = Path(path).expanduser()
    if directory.is_dir():
        if not (directory / "config.json").exists():
            raise ConfigError(f"{key}={path!r}: the directory has no config.json; give an HF model directory")
        return
    if directory.exists() or not _HUB_ID.fullmatch(path):
        raise ConfigError(
            f"{key}={path!r}: no such model directory; give an HF model directory, a hub id (org/name) "
            "on a machine that may download, or tiny/smollm2"
        )


def roles_for(skyrl_cfg: Any) -> tuple[str, ...]:
    """The worker roles a SkyRL config asks for: a critic when it has a critic model (GAE), a
    frozen reference when a KL term needs one."""
    trainer = skyrl_cfg.trainer
    roles = ["policy"]
    if trainer.critic.model.path:
        roles.append("critic")
    if trainer.algorithm.use_kl_loss or trainer.algorithm.use_kl_in_reward:
        roles.append("ref")
    return tuple(roles)


def _workers_per_node(skyrl_cfg: Any, roles: tuple[str, ...]) -> int:
    """Training worker processes on one node: one per GPU slot of each role."""
    placement = skyrl_cfg.trainer.placement
    return sum(int(getattr(placement, f"{role}_num_gpus_per_node")) for role in roles)


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
    bypass_mode: bool
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
    async_training: bool = False
    async_chunks: int = 1  # fully-async: forward-backward calls that make up one optimizer step
    cpu_threads: int = 1  # torch threads of each training worker on CPU
    warmup_steps_ratio: float = 0.0
    optimizer_steps: int | None = None  # known once the trainer says how many steps it runs
    extra: Mapping[str, Any] = field(default_factory=dict)

    def loss_for(self, role: str) -> losses.ResolvedLoss:
        """The policy loss rows of trajectory role ``role`` train with."""
        return self.role_losses.get(role, self.policy_loss)

    def with_algorithm_config(self, algorithm_config: Any) -> RunConfig:
        """A copy that takes the per-role estimators and losses the trainer's ``AlgorithmConfig`` carries.

        rLLM users set them in code (``traj_group_adv_estimator_map`` values ``estimator`` or
        ``(estimator, loss_fn)``); the loss of a role is its ``loss_fn_map`` entry, else
        ``rllm.algorithm.loss_fn``, else the default for the role's estimator.
        """
        estimator_map = {
            role: getattr(value, "value", value)
            for role, value in (getattr(algorithm_config, "estimator_map", None) or {}).items()
        }
        loss_fn_map = dict(getattr(algorithm_config, "loss_fn_map", None) or {})
        named = self.extra.get("loss_fn")
        role_losses = dict(self.role_losses)
        for role in set(estimator_map) | set(loss_fn_map):
            name = (
                loss_fn_map.get(role) or named or default_policy_loss(estimator_map.get(role, self.estimator))
            )
            try:
                role_losses[role] = losses.resolve_loss("policy", name, self.loss_fn_config)
            except ValueError as error:
                raise ConfigError(f"loss for trajectory role {role!r} ({name!r}): {error}") from error
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

    @property
    def loss_fn_config(self) -> dict[str, Any]:
        return dict(self.extra.get("loss_fn_config") or {})

    @property
    def critic_loss_fn_config(self) -> dict[str, Any]:
        return dict(self.extra.get("critic_loss_fn_config") or {})

    def for_total_steps(self, total_training_steps: int) -> RunConfig:
        """A copy that knows the run's length: optimizer steps and the warmup they imply.

        rLLM counts warmup in optimizer steps (``rllm.algorithm.warmup_steps``), or as a ratio of
        them when that is <= 0. SkyRL's schedulers count optimizer steps too.
        """
        optimizer_steps = max(int(total_training_steps or 1), 1) * self.num_minibatches * self.update_epochs
        skyrl_cfg = copy.deepcopy(self.skyrl)
        for role in ("policy", "critic"):
            optimizer = getattr(skyrl_cfg.trainer, role).optimizer_config
            if optimizer.num_warmup_steps is None or optimizer.num_warmup_steps <= 0:
                optimizer.num_warmup_steps = max(int(self.warmup_steps_ratio * optimizer_steps), 0)
        return dataclasses.replace(self, skyrl=skyrl_cfg, optimizer_steps=optimizer_steps)


def resolve_run_config(
    cfg: DictConfig,
    cli_overrides: list[str] | tuple[str, ...] = (),
    *,
    platform: Platform | None = None,
    resolve_models: bool = True,
) -> RunConfig:
    """Check and resolve everything a run needs from its config, before anything starts.

    ``cli_overrides`` are the run's command-line overrides (they decide precedence between a key
    and its counterpart, see ``bridge``). ``resolve_models=False`` keeps model names as given
    (``rllm-skyrl plan`` describes a cluster whose model may not be on this machine).
    Raises ``ConfigError`` naming the key to change.
    """
    platform = platform or Platform.detect()
    try:
        apply_aliases(cfg, cli_overrides)
        check_values(cfg)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    if OmegaConf.is_missing(cfg, "model.path") or not select(cfg, "model.path"):
        raise ConfigError(
            "model.path is not set; pass model.path=<HF model dir> (or model.name=..., tiny, smollm2)"
        )
    if resolve_models:
        for key in ("model.path", "model.critic_path"):
            check_model_path(key, select(cfg, key))
    try:
        overrides = bridge.skyrl_overrides(cfg, cli_overrides)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    model_path = overrides["trainer.policy.model.path"]
    if resolve_models:
        model_path = resolve_model_path(model_path)
        for role in ("policy", "ref", "critic"):
            key = f"trainer.{role}.model.path"
            if overrides.get(key):
                overrides[key] = resolve_model_path(overrides[key])
    try:
        lora = resolve_lora(cfg, overrides, model_path, inspect=resolve_models)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    sync_dir = (Path(overrides.get("trainer.ckpt_path") or ".") / "sync").resolve()
    serves_here = platform.server_kind(select(cfg, "inference.urls")) == "cpu_transformers"
    if lora.enabled and serves_here and not Path(lora.sync_path).is_relative_to(sync_dir):
        raise ConfigError(
            f"skyrl.trainer.policy.model.lora.lora_sync_path={lora.sync_path!r}: this package's CPU "
            f"servers load adapters only from under the run's sync directory {sync_dir}; drop the key "
            "(the adapter then goes to sync/lora there)"
        )
    for role in ("policy", "critic"):  # the trained models; null in the yaml: the platform's choice
        key = f"trainer.{role}.fsdp_config.reshard_after_forward"
        if overrides.get(key) is None:
            overrides[key] = platform.reshard_after_forward
    try:
        skyrl_cfg = make_skyrl_config(overrides, platform)
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(
            f"invalid SkyRL settings (skyrl.* or the rllm.* keys bridged to them): {error}"
        ) from error

    sampled_at = select(cfg, "rllm.rollout.train.temperature", 1.0)
    scored_at = skyrl_cfg.trainer.algorithm.temperature
    if abs(scored_at - sampled_at) > 1e-9:
        raise ConfigError(
            f"skyrl.trainer.algorithm.temperature={scored_at} differs from "
            f"rllm.rollout.train.temperature={sampled_at}: the trainer would score tokens under "
            "another distribution than they were sampled from; set rllm.rollout.train.temperature only"
        )
    estimator = select(cfg, "rllm.algorithm.adv_estimator", "grpo")
    if estimator not in SUPPORTED_ESTIMATORS:
        raise ConfigError(f"rllm.algorithm.adv_estimator={estimator!r}: choose one of {SUPPORTED_ESTIMATORS}")
    estimator_map = dict(select(cfg, "rllm.algorithm.estimator_map") or {})
    for role, role_estimator in estimator_map.items():
        if role_estimator not in OUTCOME_ESTIMATORS:
            raise ConfigError(
                f"rllm.algorithm.estimator_map.{role}={role_estimator!r}: choose one of {OUTCOME_ESTIMATORS}"
            )
    loss_fn_config = select(cfg, "training.loss_fn_config")
    critic_loss_fn_config = select(cfg, "training.critic_loss_fn_config")
    named_loss = select(cfg, "rllm.algorithm.loss_fn")
    try:
        policy_loss = losses.resolve_loss(
            "policy", named_loss or default_policy_loss(estimator), loss_fn_config
        )
        role_losses = {
            role: losses.resolve_loss(
                "policy", named_loss or default_policy_loss(role_estimator), loss_fn_config
            )
            for role, role_estimator in estimator_map.items()
        }
        critic_loss = losses.resolve_loss("critic", "ppo_critic", critic_loss_fn_config)
    except ValueError as error:
        raise ConfigError(f"rllm.algorithm.loss_fn / training.loss_fn_config: {error}") from error
    if not policy_loss.uses_advantages and policy_loss.loss_fn != "cross_entropy":
        raise ConfigError(f"rllm.algorithm.loss_fn={policy_loss.loss_fn!r} cannot train from rewards")
    loss_reduction = select(cfg, "rllm.algorithm.loss_agg_mode") or "token_mean"
    if loss_reduction.replace("-", "_") not in SKYRL_LOSS_REDUCTIONS:
        raise ConfigError(
            f"rllm.algorithm.loss_agg_mode={loss_reduction!r}: choose one of {list(SKYRL_LOSS_REDUCTIONS)}"
        )
    if select(cfg, "rllm.algorithm.rollout_correction.tis_mode"):
        raise ConfigError(
            "rllm.algorithm.rollout_correction.tis_mode is not supported by the SkyRL backend yet"
        )
    rollout_n = int(select(cfg, "rllm.rollout.n", 1))
    if rollout_n < 1:
        raise ConfigError("rllm.rollout.n must be >= 1")
    if estimator in ("grpo", "rloo") and rollout_n < 2:
        raise ConfigError(f"adv_estimator={estimator} compares rollouts of one task: set rllm.rollout.n >= 2")
    resume_mode = select(cfg, "training.resume_mode", "auto")
    if resume_mode not in RESUME_MODES:
        raise ConfigError(f"training.resume_mode={resume_mode!r}: choose one of {RESUME_MODES}")
    resume_from_path = select(cfg, "training.resume_from_path")
    if resume_mode == "resume_path" and not resume_from_path:
        raise ConfigError(
            "training.resume_mode=resume_path needs training.resume_from_path=<global_step_N dir>"
        )

    async_training = bool(select(cfg, "rllm.async_training.enable", False))
    if async_training and (
        skyrl_cfg.trainer.update_epochs_per_batch != 1 or select(cfg, "training.num_minibatches", 1) != 1
    ):
        raise ConfigError(
            "rllm.async_training.enable=true: rLLM hands the backend one optimizer step's groups in chunks "
            "(rllm.async_training.fwd_bwd_group_size) and steps once; set training.num_minibatches=1 and "
            "training.update_epochs=1 (use rllm.async_training.mini_batch_size for the step size)"
        )
    async_chunks = 1
    if async_training:
        mini_batch = int(select(cfg, "rllm.async_training.mini_batch_size", 1))
        chunk = int(select(cfg, "rllm.async_training.fwd_bwd_group_size") or mini_batch)
        if chunk < 1 or mini_batch % chunk:
            raise ConfigError(
                f"rllm.async_training.fwd_bwd_group_size={chunk} must divide "
                f"rllm.async_training.mini_batch_size={mini_batch}"
            )
        async_chunks = mini_batch // chunk
    urls = tuple(select(cfg, "inference.urls") or ())
    roles = roles_for(skyrl_cfg)
    # On-policy, rollouts and the trainer take turns on the machine's cores; fully-async they overlap.
    cores = max(1, (os.cpu_count() or 1) // (2 if async_training else 1))
    num_engines = int(select(cfg, "inference.num_engines", 1))
    return RunConfig(
        platform=platform,
        skyrl=skyrl_cfg,
        model_path=model_path,
        roles=roles,
        estimator=estimator,
        estimator_map=estimator_map,
        norm_adv_by_std=bool(select(cfg, "rllm.algorithm.norm_adv_by_std_in_grpo", True)),
        use_precomputed_advantage=bool(select(cfg, "rllm.algorithm.use_precomputed_advantage", False)),
        filter_zero_variance_groups=bool(select(cfg, "training.filter_zero_variance_groups", False)),
        policy_loss=policy_loss,
        critic_loss=critic_loss,
        role_losses=role_losses,
        loss_reduction=loss_reduction,
        bypass_mode=bool(select(cfg, "rllm.algorithm.rollout_correction.bypass_mode", True)),
        drop_malformed=bool(select(cfg, "training.drop_malformed", False)),
        rollout_n=rollout_n,
        rollout_n_val=int(select(cfg, "rllm.rollout.n_val", 1)),
        max_prompt_length=int(select(cfg, "rllm.data.max_prompt_length")),
        max_response_length=int(select(cfg, "rllm.data.max_response_length")),
        train_sampling=_sampling(select(cfg, "rllm.rollout.train")),
        val_sampling=_sampling(select(cfg, "rllm.rollout.val")),
        inference=InferenceSettings(
            urls=urls,
            num_engines=num_engines,
            max_model_len=select(cfg, "inference.max_model_len"),
            max_batch_size=int(select(cfg, "inference.max_batch_size", 256)),
            deterministic_sampling=bool(select(cfg, "inference.deterministic_sampling", False)),
            threads=int(select(cfg, "inference.threads") or max(1, cores // num_engines)),
        ),
        checkpoint=CheckpointSettings(
            root=Path(skyrl_cfg.trainer.ckpt_path),
            save_freq=int(select(cfg, "rllm.trainer.save_freq", 0) or 0),
            resume_mode=resume_mode,
            resume_from_path=resume_from_path,
            max_to_keep=int(select(cfg, "training.max_ckpts_to_keep", -1)),
        ),
        rollout=RolloutSettings(
            disable_thinking=bool(select(cfg, "rllm.disable_thinking", False)),
            render_with_parser=bool(select(cfg, "rollout_engine.bypass_render_with_parser", False)),
            reasoning_effort=select(cfg, "rollout_engine.reasoning_effort"),
        ),
        lora=lora,
        async_training=async_training,
        async_chunks=async_chunks,
        cpu_threads=int(
            select(cfg, "training.cpu_threads") or max(1, cores // _workers_per_node(skyrl_cfg, roles))
        ),
        warmup_steps_ratio=float(select(cfg, "rllm.algorithm.warmup_steps_ratio", 0.0) or 0.0),
        extra={
            "loss_fn": named_loss,
            "loss_fn_config": loss_fn_config,
            "critic_loss_fn_config": critic_loss_fn_config,
        },
    )


def _sampling(section: Mapping[str, Any] | None) -> dict[str, Any]:
    return {key: value for key, value in (section or {}).items() if value is not None}
