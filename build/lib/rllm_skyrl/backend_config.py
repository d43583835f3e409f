"""Checking a run's config before anything starts: every error names the key to change.

The backend's ``validate_config`` runs before Ray, workers, servers or loggers exist (rLLM's
contract), so everything that can be decided from the config alone is decided here: SkyRL's typed
config (via the rLLM->SkyRL bridge), the estimator, the loss for each role, the loss reduction,
the resume mode, and the sampling/scoring temperature agreement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm_skyrl import advantages, config_bridge, losses

OUTCOME_ESTIMATORS = ("grpo", "rloo", "reinforce", "reinforce_plus_plus_baseline")
SUPPORTED_ESTIMATORS = (*OUTCOME_ESTIMATORS, "gae")
RESUME_MODES = ("auto", "disable", "resume_path")


@dataclass(frozen=True)
class CheckedConfig:
    skyrl_cfg: Any
    policy_loss: losses.ResolvedLoss
    critic_loss: losses.ResolvedLoss
    loss_reduction: str


def as_dict(section: Any) -> dict[str, Any] | None:
    """A config section as a plain dict (``None`` stays ``None``)."""
    if section is None:
        return None
    return OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else dict(section)


def check_config(config: DictConfig, cli_overrides: list[str]) -> CheckedConfig:
    """Resolve and check everything the backend needs from the config; raise naming the key."""
    from rllm_skyrl.workers import make_skyrl_config

    if OmegaConf.is_missing(config, "model.path") or not _get(config, "model.path"):
        raise ValueError("model.path is not set; pass model.path=<HF model dir> (or model.path=tiny)")
    try:
        skyrl_cfg = make_skyrl_config(config_bridge.skyrl_overrides(config, cli_overrides))
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"invalid SkyRL settings (skyrl.* or the rllm.* keys bridged to them): {error}"
        ) from error

    sampled_at = _get(config, "rllm.rollout.train.temperature", 1.0)
    scored_at = skyrl_cfg.trainer.algorithm.temperature
    if abs(scored_at - sampled_at) > 1e-9:
        raise ValueError(
            f"skyrl.trainer.algorithm.temperature={scored_at} differs from "
            f"rllm.rollout.train.temperature={sampled_at}: the trainer would score tokens under "
            "another distribution than they were sampled from; set rllm.rollout.train.temperature only"
        )
    estimator = _get(config, "rllm.algorithm.adv_estimator", "grpo")
    if estimator not in SUPPORTED_ESTIMATORS:
        raise ValueError(f"rllm.algorithm.adv_estimator={estimator!r}: choose one of {SUPPORTED_ESTIMATORS}")
    for role, role_estimator in (_get(config, "rllm.algorithm.estimator_map") or {}).items():
        if role_estimator not in OUTCOME_ESTIMATORS:
            raise ValueError(
                f"rllm.algorithm.estimator_map.{role}={role_estimator!r}: choose one of {OUTCOME_ESTIMATORS}"
            )
    policy_loss = losses.resolve_loss(
        "policy",
        _get(config, "rllm.algorithm.loss_fn") or "ppo",
        as_dict(_get(config, "training.loss_fn_config")),
    )
    if not policy_loss.uses_advantages and policy_loss.loss_fn != "cross_entropy":
        raise ValueError(f"rllm.algorithm.loss_fn={policy_loss.loss_fn!r} cannot train from rewards")
    critic_loss = losses.resolve_loss(
        "critic", "ppo_critic", as_dict(_get(config, "training.critic_loss_fn_config"))
    )
    loss_reduction = _get(config, "rllm.algorithm.loss_agg_mode") or "token_mean"
    if loss_reduction.replace("-", "_") not in advantages.LOSS_REDUCTIONS:
        raise ValueError(
            f"rllm.algorithm.loss_agg_mode={loss_reduction!r}: "
            f"choose one of {list(advantages.LOSS_REDUCTIONS)}"
        )
    if _get(config, "rllm.algorithm.rollout_correction.tis_mode"):
        raise ValueError(
            "rllm.algorithm.rollout_correction.tis_mode is not supported by the SkyRL backend yet"
        )
    if _get(config, "rllm.rollout.n", 1) < 1:
        raise ValueError("rllm.rollout.n must be >= 1")
    if estimator in ("grpo", "rloo") and _get(config, "rllm.rollout.n", 1) < 2:
        raise ValueError(f"adv_estimator={estimator} compares rollouts of one task: set rllm.rollout.n >= 2")
    resume_mode = _get(config, "training.resume_mode", "auto")
    if resume_mode not in RESUME_MODES:
        raise ValueError(f"training.resume_mode={resume_mode!r}: choose auto, disable or resume_path")
    if resume_mode == "resume_path" and not _get(config, "training.resume_from_path"):
        raise ValueError(
            "training.resume_mode=resume_path needs training.resume_from_path=<global_step_N dir>"
        )
    return CheckedConfig(skyrl_cfg, policy_loss, critic_loss, loss_reduction)


def _get(config: DictConfig, key: str, default: Any = None) -> Any:
    return OmegaConf.select(config, key, default=default)
