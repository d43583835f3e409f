"""Keys of rLLM's other backends (``tinker.yaml``, ``verl.yaml``), accepted under their own names.

A user moving from ``rllm/backend=tinker`` or ``=verl`` keeps their command line: a key that means
something here is an *alias* of a key of ours; one that means nothing here is *refused* with the
reason unless its value asks for nothing (``null``, or what this backend does anyway). Nothing is
silently ignored. The backend's yaml declares every key of this table as null (so Hydra accepts
them without ``+``); a test holds the yaml, this table and the README's table together.

A set alias beats its target (the package docstring's rule 1). ``with_aliases`` writes the aliases
onto their targets in a new config, so interpolations that read a target follow, and the launchers
hand it to the trainer, whose data loaders then see the backend's batch size (as rLLM's own
launchers sync ``data.*`` into ``rllm.data.*``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from rllm_skyrl.run_config.settings import ConfigError
from rllm_skyrl.run_config.tree import select


@dataclass(frozen=True)
class Alias:
    """``key`` (another backend's) means ``target`` (ours)."""

    key: str
    target: str
    backend: str

    @property
    def effect(self) -> str:
        return f"same as `{self.target}`"


@dataclass(frozen=True)
class Refused:
    """``key`` has no meaning here; any value but ``inert`` ones is an error saying ``why``."""

    key: str
    backend: str
    why: str
    inert: tuple[Any, ...] = (None,)

    @property
    def effect(self) -> str:
        allowed = ", ".join("null" if v is None else repr(v) for v in self.inert)
        return f"refused unless {allowed}: {self.why}"


TINKER, VERL, BOTH = "tinker", "verl", "tinker, verl"
LEGACY = "tinker (rLLM's older tinker_rl_trainer.yaml)"
_INFERENCE_PLACEMENT = (
    "inference placement is SkyRL's: skyrl.generator.inference_engine.num_engines (GPU) or "
    "inference.num_engines (CPU)"
)

KEYS: tuple[Alias | Refused, ...] = (
    # --- rLLM's tinker.yaml --------------------------------------------------------------------------
    Alias("model.name", "model.path", TINKER),
    Alias("training.lr_schedule", "rllm.algorithm.lr_schedule", TINKER),
    Alias("training.warmup_steps_ratio", "rllm.algorithm.warmup_steps_ratio", TINKER),
    Alias("training.max_length", "inference.max_model_len", TINKER),
    Alias("data.train_batch_size", "rllm.data.train_batch_size", BOTH),
    Alias("data.val_batch_size", "rllm.data.val_batch_size", BOTH),
    Alias("data.max_prompt_length", "rllm.data.max_prompt_length", BOTH),
    Alias("data.max_response_length", "rllm.data.max_response_length", BOTH),
    Alias("rollout_engine.disable_thinking", "rllm.disable_thinking", TINKER),
    Alias("rollout_engine.accumulate_reasoning", "rllm.accumulate_reasoning", TINKER),
    Alias("sampling.train.temperature", "rllm.rollout.train.temperature", LEGACY),
    Alias("sampling.train.top_p", "rllm.rollout.train.top_p", LEGACY),
    Alias("sampling.val.temperature", "rllm.rollout.val.temperature", LEGACY),
    Alias("sampling.val.top_p", "rllm.rollout.val.top_p", LEGACY),
    Alias("workflow.n_parallel_tasks", "rllm.workflow.n_parallel_tasks", TINKER),
    Alias("workflow.retry_limit", "rllm.workflow.retry_limit", TINKER),
    Refused(
        "model.train_unembed",
        TINKER,
        "adapters go on attention and MLP layers only (model.train_attn, model.train_mlp): SkyRL hands "
        "the adapter to vLLM, which adapts lm_head for some architectures only and not when it is tied "
        "to the input embedding",
        (None, False),
    ),
    Refused(
        "training.eps",
        TINKER,
        "SkyRL's AdamW has no epsilon setting; it uses torch's default 1e-8",
        (None, 1e-8),
    ),
    Refused(
        "data.train_files",
        BOTH,
        "datasets are given to the trainer (train_dataset=..., or rLLM's DatasetRegistry), not by path",
    ),
    Refused("data.val_files", BOTH, "datasets are given to the trainer (val_dataset=...), not by path"),
    Refused(
        "rollout_engine.renderer_name",
        TINKER,
        "tinker-cookbook renderers do not exist here; prompts use the model's chat template, or rLLM's "
        "chat parser with rollout_engine.bypass_render_with_parser=true",
    ),
    Refused(
        "tinker_base_url", TINKER, "there is no Tinker service; SkyRL's workers train in this Ray cluster"
    ),
    Refused(
        "fuse_forward_backward_and_optim_step",
        TINKER,
        "SkyRL's workers take forward_backward and optim_step as separate calls",
        (None, False),
    ),
    Refused(
        "agent.max_steps", TINKER, "rLLM's unified trainer never reads it; pass max_steps to your workflow"
    ),
    Refused(
        "agent.agent_args", TINKER, "rLLM's unified trainer never reads it; pass agent_args to your workflow"
    ),
    # --- rLLM's verl.yaml and the verl keys rLLM syncs into rllm.* --------------------------------
    Alias("actor_rollout_ref.model.path", "model.path", VERL),
    Alias("actor_rollout_ref.model.lora_rank", "model.lora_rank", VERL),
    Alias("actor_rollout_ref.model.lora.rank", "model.lora_rank", VERL),
    Alias("actor_rollout_ref.model.lora_alpha", "model.lora_alpha", VERL),
    Alias("actor_rollout_ref.model.lora.alpha", "model.lora_alpha", VERL),
    Alias("actor_rollout_ref.model.target_modules", "model.lora_target_modules", VERL),
    Alias("actor_rollout_ref.actor.optim.lr", "training.learning_rate", VERL),
    Alias("actor_rollout_ref.actor.optim.weight_decay", "training.weight_decay", VERL),
    Alias("actor_rollout_ref.actor.optim.lr_warmup_steps", "rllm.algorithm.warmup_steps", VERL),
    Alias("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "rllm.algorithm.warmup_steps_ratio", VERL),
    Alias("actor_rollout_ref.actor.grad_clip", "training.max_grad_norm", VERL),
    Alias("actor_rollout_ref.actor.ppo_epochs", "training.update_epochs", VERL),
    Alias("actor_rollout_ref.actor.ppo_mini_batch_size", "skyrl.trainer.policy_mini_batch_size", VERL),
    Alias(
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "skyrl.trainer.micro_train_batch_size_per_gpu",
        VERL,
    ),
    Alias(
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "skyrl.trainer.micro_forward_batch_size_per_gpu",
        VERL,
    ),
    Alias("actor_rollout_ref.actor.clip_ratio", "rllm.algorithm.eps_clip", VERL),
    Alias("actor_rollout_ref.actor.clip_ratio_low", "rllm.algorithm.eps_clip", VERL),
    Alias("actor_rollout_ref.actor.clip_ratio_high", "rllm.algorithm.eps_clip_high", VERL),
    Alias("actor_rollout_ref.actor.kl_loss_coef", "rllm.algorithm.kl_beta", VERL),
    Alias("actor_rollout_ref.actor.loss_agg_mode", "rllm.algorithm.loss_agg_mode", VERL),
    Alias("actor_rollout_ref.actor.policy_loss.loss_mode", "rllm.algorithm.loss_fn", VERL),
    Alias(
        "actor_rollout_ref.model.enable_gradient_checkpointing", "skyrl.trainer.gradient_checkpointing", VERL
    ),
    Alias("actor_rollout_ref.rollout.n", "rllm.rollout.n", VERL),
    Alias("actor_rollout_ref.rollout.val_kwargs.n", "rllm.rollout.n_val", VERL),
    Alias("actor_rollout_ref.rollout.temperature", "rllm.rollout.train.temperature", VERL),
    Alias("actor_rollout_ref.rollout.top_p", "rllm.rollout.train.top_p", VERL),
    Alias("actor_rollout_ref.rollout.top_k", "rllm.rollout.train.top_k", VERL),
    Alias("actor_rollout_ref.rollout.response_length", "rllm.rollout.train.max_tokens", VERL),
    Alias("actor_rollout_ref.rollout.val_kwargs.temperature", "rllm.rollout.val.temperature", VERL),
    Alias("actor_rollout_ref.rollout.val_kwargs.top_p", "rllm.rollout.val.top_p", VERL),
    Alias("actor_rollout_ref.rollout.val_kwargs.top_k", "rllm.rollout.val.top_k", VERL),
    Alias("actor_rollout_ref.rollout.max_model_len", "inference.max_model_len", VERL),
    Alias(
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "skyrl.generator.inference_engine.tensor_parallel_size",
        VERL,
    ),
    Alias(
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "skyrl.generator.inference_engine.gpu_memory_utilization",
        VERL,
    ),
    Alias("actor_rollout_ref.rollout.enforce_eager", "skyrl.generator.inference_engine.enforce_eager", VERL),
    Refused(
        "actor_rollout_ref.rollout.name",
        VERL,
        "SkyRL serves rollouts with vLLM on GPUs (this package's transformers server on CPU)",
        (None, "vllm"),
    ),
    Refused(
        "actor_rollout_ref.rollout.mode",
        VERL,
        "rollouts are always served by HTTP inference servers (verl's async mode)",
        (None, "async"),
    ),
    Refused(
        "actor_rollout_ref.actor.use_kl_loss",
        VERL,
        "the KL loss is on exactly when rllm.algorithm.kl_beta > 0; set that instead",
        (None, False),
    ),
    Alias("critic.optim.lr", "training.critic_learning_rate", VERL),
    Alias("critic.model.path", "model.critic_path", VERL),
    Alias("algorithm.adv_estimator", "rllm.algorithm.adv_estimator", VERL),
    Alias("algorithm.norm_adv_by_std_in_grpo", "rllm.algorithm.norm_adv_by_std_in_grpo", VERL),
    Alias("algorithm.gamma", "skyrl.trainer.algorithm.gamma", VERL),
    Alias("algorithm.lam", "skyrl.trainer.algorithm.lambd", VERL),
    Alias("algorithm.rollout_correction.bypass_mode", "rllm.algorithm.rollout_correction.bypass_mode", VERL),
    Alias("trainer.n_gpus_per_node", "skyrl.trainer.placement.policy_num_gpus_per_node", VERL),
    Alias("trainer.nnodes", "skyrl.trainer.placement.policy_num_nodes", VERL),
    Alias("trainer.total_epochs", "rllm.trainer.total_epochs", VERL),
    Alias("trainer.total_training_steps", "rllm.trainer.total_batches", VERL),
    Alias("trainer.save_freq", "rllm.trainer.save_freq", VERL),
    Alias("trainer.test_freq", "rllm.trainer.test_freq", VERL),
    Alias("trainer.val_before_train", "rllm.trainer.val_before_train", VERL),
    Alias("trainer.project_name", "rllm.trainer.project_name", VERL),
    Alias("trainer.experiment_name", "rllm.trainer.experiment_name", VERL),
    Alias("trainer.logger", "rllm.trainer.logger", VERL),
    Alias("trainer.default_local_dir", "training.default_local_dir", VERL),
    Alias("trainer.resume_mode", "training.resume_mode", VERL),
    Alias("trainer.max_actor_ckpt_to_keep", "training.max_ckpts_to_keep", VERL),
    Refused("trainer.critic_warmup", VERL, "the critic and the policy train from the first step"),
    Refused("rollout.nnodes", VERL, _INFERENCE_PLACEMENT),
    Refused("rollout.n_gpus_per_node", VERL, _INFERENCE_PLACEMENT),
)


def alias_values(cfg: DictConfig) -> dict[str, Any]:
    """``{target: value}`` for every alias set in ``cfg``. Raises ``ConfigError`` for a refused key
    that asks for something, and for two aliases of one target that disagree."""
    values: dict[str, Any] = {}
    setters: dict[str, str] = {}
    for spec in KEYS:
        value = select(cfg, spec.key)
        if isinstance(spec, Refused):
            if value not in spec.inert:
                raise ConfigError(f"{spec.key}={value!r} ({spec.backend}): {spec.why}")
            continue
        if value is None:
            continue
        if spec.target in values and values[spec.target] != value:
            raise ConfigError(
                f"{spec.key}={value!r} and {setters[spec.target]}={values[spec.target]!r} are both names for "
                f"{spec.target} and disagree; set one of them"
            )
        values[spec.target], setters[spec.target] = value, spec.key
    return values


def with_aliases(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with every set alias written onto its target; idempotent."""
    values = alias_values(cfg)
    aliased = copy.deepcopy(cfg)
    with read_write(aliased), open_dict(aliased):
        for target, value in values.items():
            OmegaConf.update(aliased, target, value, merge=False, force_add=True)
    return aliased


def trainer_keys_behind(cfg: DictConfig) -> dict[str, Any]:
    """``{rllm key: alias value}`` for the ``rllm.*`` targets whose set alias holds another value:
    the keys rLLM's trainer, which reads ``rllm.*`` itself (batch sizes, the algorithm section),
    would read differently from the backend if handed ``cfg`` rather than ``with_aliases(cfg)``."""
    return {
        target: value
        for target, value in alias_values(cfg).items()
        if target.startswith("rllm.") and select(cfg, target) != value
    }


def table_markdown() -> str:
    """The README's key table, from ``KEYS``."""
    lines = ["| key | from | effect here |", "|---|---|---|"]
    lines += [f"| `{spec.key}` | {spec.backend} | {spec.effect} |" for spec in KEYS]
    return "\n".join(lines)
