"""Every user-facing setting checked for type and range before anything starts, one table.

A wrong value is refused with one line naming the key, the value and what is allowed, before Ray,
workers or servers exist; SkyRL would otherwise take it and fail minutes later inside a worker.
Keys absent from the composed config (e.g. rLLM keys of an older rLLM) are not checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from rllm_skyrl.run_config.tree import select

_ABSENT = object()


@dataclass(frozen=True)
class Rule:
    """What ``key`` accepts: ``check(value)`` is true when allowed; ``allowed`` says it in words."""

    key: str
    check: Callable[[Any], bool]
    allowed: str
    nullable: bool = False


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def at_least(low: int) -> Callable[[Any], bool]:
    return lambda value: _int(value) and value >= low


def positive(value: Any) -> bool:
    return _real(value) and value > 0


def non_negative(value: Any) -> bool:
    return _real(value) and value >= 0


def one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda value: value in choices


def boolean(value: Any) -> bool:
    return isinstance(value, bool)


def text(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


def text_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(text(item) for item in value)


def _sampling(prefix: str) -> list[Rule]:
    return [
        Rule(f"{prefix}.temperature", positive, "a number > 0"),
        Rule(f"{prefix}.top_p", lambda v: _real(v) and 0 < v <= 1, "a number in (0, 1]"),
        Rule(f"{prefix}.top_k", lambda v: _int(v) and v >= -1, "-1 (off) or an integer >= 1", nullable=True),
        Rule(f"{prefix}.max_tokens", at_least(1), "an integer >= 1", nullable=True),
    ]


_USE_RLLM = "null or true (deprecated in rLLM: advantages are always rLLM's own estimators)"
_ROUTER_REPLAY = (
    "'disabled' (R2 and R3 replay MoE expert routing in the trainer's forward, which SkyRL does only "
    "in its Megatron workers; this backend trains with FSDP)"
)
_TIS_MODE = "null (off), token or sequence (SkyRL's off_policy_correction.tis_ratio_type)"
_STEPWISE = (
    "'broadcast' (one advantage per trajectory, broadcast to its steps: rLLM's unified trainer "
    "deprecates per_step)"
)

RESUME_MODES = ("auto", "disable", "resume_path")  # ``training.resume_mode``

RULES: tuple[Rule, ...] = (
    Rule("training.group_size", at_least(1), "an integer >= 1"),
    Rule("validation.group_size", at_least(1), "an integer >= 1"),
    Rule("training.learning_rate", positive, "a number > 0"),
    Rule("training.critic_learning_rate", positive, "a number > 0"),
    Rule("training.weight_decay", non_negative, "a number >= 0"),
    Rule("training.max_grad_norm", positive, "a number > 0"),
    Rule("training.beta1", lambda v: _real(v) and 0 <= v < 1, "a number in [0, 1)"),
    Rule("training.beta2", lambda v: _real(v) and 0 <= v < 1, "a number in [0, 1)"),
    Rule("training.num_minibatches", at_least(1), "an integer >= 1"),
    Rule("training.update_epochs", at_least(1), "an integer >= 1"),
    Rule("training.max_ckpts_to_keep", lambda v: _int(v) and v != 0 and v >= -1, "-1 (keep all) or >= 1"),
    Rule("training.drop_malformed", boolean, "true or false"),
    Rule("training.resume_mode", one_of(*RESUME_MODES), " or ".join(RESUME_MODES)),
    Rule("training.filter_zero_variance_groups", boolean, "true or false"),
    Rule("training.default_local_dir", text, "a directory path"),
    Rule(
        "training.loss_fn_config", lambda v: isinstance(v, dict), "a mapping of loss options", nullable=True
    ),
    Rule("training.critic_loss_fn_config", lambda v: isinstance(v, dict), "a mapping", nullable=True),
    Rule("inference.num_engines", at_least(1), "an integer >= 1"),
    Rule("inference.max_model_len", at_least(1), "an integer >= 1", nullable=True),
    Rule("inference.max_batch_size", at_least(1), "an integer >= 1"),
    Rule("inference.deterministic_sampling", boolean, "true or false"),
    Rule("inference.threads", at_least(1), "an integer >= 1", nullable=True),
    Rule("training.cpu_threads", at_least(1), "an integer >= 1", nullable=True),
    Rule(
        "inference.urls",
        lambda v: (
            isinstance(v, list | tuple) and v and all(str(u).startswith(("http://", "https://")) for u in v)
        ),
        "a non-empty list of http(s) URLs",
        nullable=True,
    ),
    Rule("rllm.data.train_batch_size", at_least(1), "an integer >= 1"),
    Rule("rllm.data.val_batch_size", lambda v: _int(v) and (v == -1 or v >= 1), "-1 (all) or >= 1"),
    Rule("rllm.data.max_prompt_length", at_least(1), "an integer >= 1"),
    Rule("rllm.data.max_response_length", at_least(1), "an integer >= 1"),
    Rule("rllm.rollout.n", at_least(1), "an integer >= 1"),
    Rule("rllm.rollout.n_val", at_least(1), "an integer >= 1"),
    *_sampling("rllm.rollout.train"),
    *_sampling("rllm.rollout.val"),
    Rule("rllm.trainer.total_epochs", at_least(1), "an integer >= 1"),
    Rule("rllm.trainer.total_batches", _int, "an integer (<= 0: every epoch)"),
    Rule("rllm.trainer.test_freq", at_least(0), "an integer >= 0 (0: never)"),
    Rule("rllm.trainer.save_freq", _int, "an integer (<= 0: no checkpoints)"),
    Rule("rllm.trainer.project_name", text, "a non-empty name"),
    Rule("rllm.trainer.experiment_name", text, "a non-empty name"),
    Rule("rllm.trainer.logger", lambda v: text(v) or text_list(v), "a logger name or a list of them"),
    Rule("rllm.trainer.val_before_train", boolean, "true or false"),
    Rule("rllm.workflow.n_parallel_tasks", at_least(1), "an integer >= 1"),
    Rule("rllm.workflow.retry_limit", at_least(1), "an integer >= 1"),
    Rule("rllm.workflow.raise_on_error", boolean, "true or false"),
    Rule("rllm.algorithm.norm_adv_by_std_in_grpo", boolean, "true or false"),
    Rule("rllm.algorithm.use_precomputed_advantage", boolean, "true or false"),
    Rule("rllm.algorithm.kl_beta", non_negative, "a number >= 0"),
    Rule("rllm.algorithm.eps_clip", lambda v: _real(v) and 0 < v < 1, "a number in (0, 1)"),
    Rule("rllm.algorithm.eps_clip_high", positive, "a number > 0", nullable=True),
    Rule("rllm.algorithm.warmup_steps", _int, "an integer (<= 0: use warmup_steps_ratio)"),
    Rule("rllm.algorithm.warmup_steps_ratio", lambda v: _real(v) and 0 <= v <= 1, "a number in [0, 1]"),
    Rule("rllm.algorithm.use_rllm", lambda v: v is True, _USE_RLLM, nullable=True),
    Rule("rllm.algorithm.router_replay", one_of("disabled"), _ROUTER_REPLAY),
    Rule("rllm.algorithm.rollout_correction.tis_mode", one_of("token", "sequence"), _TIS_MODE, nullable=True),
    Rule("rllm.algorithm.rollout_correction.tis_cap", positive, "a number > 0 (the cap on the TIS weight)"),
    Rule(
        "rllm.algorithm.rollout_correction.bypass_mode", boolean, "true, false or null (true)", nullable=True
    ),
    Rule("rllm.stepwise_advantage.mode", one_of("broadcast"), _STEPWISE),
    Rule("rllm.async_training.mini_batch_size", at_least(1), "an integer >= 1"),
    Rule("rllm.async_training.fwd_bwd_group_size", at_least(1), "an integer >= 1", nullable=True),
    Rule("rllm.async_training.staleness_threshold", non_negative, "a number >= 0"),
    Rule("rllm.async_training.trigger_parameter_sync_step", at_least(1), "an integer >= 1"),
    Rule("skyrl.trainer.seed", _int, "an integer"),
    Rule("skyrl.trainer.micro_train_batch_size_per_gpu", at_least(1), "an integer >= 1"),
    Rule("skyrl.trainer.micro_forward_batch_size_per_gpu", at_least(1), "an integer >= 1"),
)


def check_values(cfg: DictConfig) -> None:
    """Raise ``ValueError("<key>=<value>: expected <allowed>")`` for the first value out of place."""
    for rule in RULES:
        value = select(cfg, rule.key, _ABSENT)
        if value is _ABSENT or (value is None and rule.nullable):
            continue
        if value is None or not rule.check(value):
            raise ValueError(f"{rule.key}={value!r}: expected {rule.allowed}")
