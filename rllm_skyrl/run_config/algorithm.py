"""The algorithm section: advantage estimators, policy and critic losses, loss reduction, old logprobs.

The per-role losses rLLM users set in code come later, with the trainer's ``AlgorithmConfig``
(``RunConfig.with_algorithm_config``), by the same default and the same off-policy checks.
Off-policy correction is resolved once SkyRL's config exists: it decides whether each policy loss
can apply it, and in bypass mode trains every loss through its decoupled variant
(``rllm_skyrl.update.off_policy`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from rllm_skyrl.run_config import losses
from rllm_skyrl.run_config.tree import select

# rLLM's outcome estimators (``advantages``); GAE is SkyRL's and needs a critic.
OUTCOME_ESTIMATORS = ("grpo", "rloo", "reinforce", "reinforce_plus_plus_baseline", "prpo")
SUPPORTED_ESTIMATORS = (*OUTCOME_ESTIMATORS, "gae")
# Estimators that compare the rollouts of one task, so they need several of them.
_GROUP_ESTIMATORS = ("grpo", "rloo")

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
    return _LOSS_BY_ESTIMATOR.get(estimator, "importance_sampling")


def _policy_loss(estimator: str, named: str | None, loss_fn_config: Any) -> losses.ResolvedLoss:
    return losses.resolve_loss("policy", named or default_policy_loss(estimator), loss_fn_config)


def resolve_algorithm(cfg: DictConfig) -> dict[str, Any]:
    """The ``RunConfig`` fields of the algorithm section. Raises ``ValueError`` naming the key."""
    estimator = select(cfg, "rllm.algorithm.adv_estimator", "grpo")
    if estimator not in SUPPORTED_ESTIMATORS:
        raise ValueError(f"rllm.algorithm.adv_estimator={estimator!r}: choose one of {SUPPORTED_ESTIMATORS}")
    estimator_map, loss_fn_map = _role_maps(select(cfg, "rllm.algorithm.estimator_map") or {})
    rollout_n = int(select(cfg, "rllm.rollout.n", 1))
    if estimator in _GROUP_ESTIMATORS and rollout_n < 2:
        raise ValueError(f"adv_estimator={estimator} compares rollouts of one task: set rllm.rollout.n >= 2")
    return {
        "estimator": estimator,
        "estimator_map": estimator_map,
        "norm_adv_by_std": bool(select(cfg, "rllm.algorithm.norm_adv_by_std_in_grpo", True)),
        "use_precomputed_advantage": bool(select(cfg, "rllm.algorithm.use_precomputed_advantage", False)),
        "filter_zero_variance_groups": bool(select(cfg, "training.filter_zero_variance_groups", False)),
        **_losses(cfg, estimator, estimator_map, loss_fn_map),
        "bypass_mode": bool(select(cfg, "rllm.algorithm.rollout_correction.bypass_mode", True)),
    }


def _role_maps(raw: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """``rllm.algorithm.estimator_map`` -> per-role estimators and losses; a value is an estimator
    or ``[estimator, loss_fn]``, as rLLM's ``AlgorithmConfig`` takes ``(estimator, loss_fn)`` tuples."""
    estimators: dict[str, str] = {}
    role_losses: dict[str, str] = {}
    for role, value in raw.items():
        if isinstance(value, str):
            estimator, loss_fn = value, None
        elif isinstance(value, list | tuple) and len(value) == 2:
            estimator, loss_fn = value
        else:
            estimator = loss_fn = None
        if estimator not in OUTCOME_ESTIMATORS:
            raise ValueError(
                f"rllm.algorithm.estimator_map.{role}={value!r}: choose one of {OUTCOME_ESTIMATORS}, "
                "or [estimator, loss_fn]"
            )
        estimators[role] = estimator
        if loss_fn is not None:
            role_losses[role] = loss_fn
    return estimators, role_losses


def _losses(
    cfg: DictConfig, estimator: str, estimator_map: dict[str, str], loss_fn_map: dict[str, str]
) -> dict[str, Any]:
    loss_fn_config = select(cfg, "training.loss_fn_config")
    critic_loss_fn_config = select(cfg, "training.critic_loss_fn_config")
    named = select(cfg, "rllm.algorithm.loss_fn")
    try:
        policy_loss = _policy_loss(estimator, named, loss_fn_config)
        role_losses = {
            role: _policy_loss(role_estimator, loss_fn_map.get(role) or named, loss_fn_config)
            for role, role_estimator in estimator_map.items()
        }
        critic_loss = losses.resolve_loss("critic", "ppo_critic", critic_loss_fn_config)
    except ValueError as error:
        raise ValueError(f"rllm.algorithm.loss_fn / training.loss_fn_config: {error}") from error
    if not policy_loss.uses_advantages and policy_loss.loss_fn != "cross_entropy":
        raise ValueError(f"rllm.algorithm.loss_fn={policy_loss.loss_fn!r} cannot train from rewards")
    reduction = select(cfg, "rllm.algorithm.loss_agg_mode") or "token_mean"
    if reduction.replace("-", "_") not in SKYRL_LOSS_REDUCTIONS:
        raise ValueError(
            f"rllm.algorithm.loss_agg_mode={reduction!r}: choose one of {list(SKYRL_LOSS_REDUCTIONS)}"
        )
    return {
        "policy_loss": policy_loss,
        "critic_loss": critic_loss,
        "role_losses": role_losses,
        "loss_reduction": reduction,
        "loss_fn": named,
        "loss_fn_config": loss_fn_config,
    }


# ---------------------------------------------------------------------------- off-policy correction


@dataclass(frozen=True)
class OffPolicySettings:
    """SkyRL's off-policy correction as a run trains with it. ``setting``: the ``key=value`` that
    turned it on (for messages), None when off; ``decoupled``: bypass mode (decoupled losses)."""

    setting: str | None = None
    decoupled: bool = False
    cispo_anchor: str = "old"  # SkyRL's trainer.algorithm.cispo.cispo_anchor: cispo losses' default

    def loss(self, loss: losses.ResolvedLoss, who: str) -> losses.ResolvedLoss:
        """``loss`` as the run trains it. Raises ``ValueError`` when it cannot apply the correction."""
        if self.setting is None:
            return loss
        reason = losses.uncorrected_reason(loss, self.cispo_anchor)
        if reason is not None:
            raise ValueError(
                f"{self.setting} cannot apply to {who}: {reason}; use ppo, gspo or cispo there "
                "(SkyRL's losses that apply it)"
            )
        return losses.decoupled(loss) if self.decoupled else loss


def off_policy_settings(cfg: DictConfig, skyrl_cfg: Any, bypass_mode: bool) -> OffPolicySettings:
    trainer = skyrl_cfg.trainer
    setting = _correction_setting(cfg, trainer.algorithm.off_policy_correction)
    minibatches = trainer.train_batch_size // trainer.policy_mini_batch_size
    epochs = trainer.update_epochs_per_batch
    if setting is not None and bypass_mode and minibatches * epochs > 1:
        raise ValueError(
            f"{setting} with rllm.algorithm.rollout_correction.bypass_mode=true and "
            f"{minibatches * epochs} optimizer steps per batch (training.num_minibatches={minibatches}, "
            f"training.update_epochs={epochs}): bypass mode weighs the rollout's log-probs against the "
            "trainer's own, which are the policy before the update only until the batch's first step; "
            "set rllm.algorithm.rollout_correction.bypass_mode=false (the old log-probs are then "
            "recomputed once before the update)"
        )
    return OffPolicySettings(
        setting, setting is not None and bypass_mode, trainer.algorithm.cispo.cispo_anchor
    )


def _correction_setting(cfg: DictConfig, correction: Any) -> str | None:
    """The ``key=value`` that turns SkyRL's off-policy correction on, or None: SkyRL's own test
    (``off_policy_correction_utils.off_policy_correction_enabled``) read off the config, since the
    config layer imports no torch (and that module does)."""
    tis_mode = select(cfg, "rllm.algorithm.rollout_correction.tis_mode")
    if tis_mode is not None:
        return f"rllm.algorithm.rollout_correction.tis_mode={tis_mode!r}"
    switches = ["tis_ratio_type", "sequence_mask_metric"]
    switches += ["outlier_token_is_threshold_low", "outlier_token_is_threshold_high"]
    low, high = correction.token_mask_is_threshold_low, correction.token_mask_is_threshold_high
    if low is not None and high is not None:  # token masking needs both thresholds
        switches.append("token_mask_is_threshold_low")
    for name in switches:
        value = getattr(correction, name)
        if value is not None:
            return f"skyrl.trainer.algorithm.off_policy_correction.{name}={value!r}"
    return None


def with_off_policy_correction(algorithm: dict[str, Any], cfg: DictConfig, skyrl_cfg: Any) -> dict[str, Any]:
    """The algorithm section's losses checked against the off-policy correction (decoupled in bypass mode)."""
    settings = off_policy_settings(cfg, skyrl_cfg, algorithm["bypass_mode"])
    policy_loss = algorithm["policy_loss"]
    who = (
        f"rllm.algorithm.loss_fn={policy_loss.loss_fn!r}"
        if algorithm["loss_fn"]
        else f"rllm.algorithm.loss_fn=null (adv_estimator={algorithm['estimator']}: {policy_loss.loss_fn!r})"
    )
    return {
        **algorithm,
        "off_policy": settings,
        "policy_loss": settings.loss(policy_loss, who),
        "role_losses": {
            role: settings.loss(loss, f"the loss of trajectory role {role!r} ({loss.loss_fn!r})")
            for role, loss in algorithm["role_losses"].items()
        },
    }
