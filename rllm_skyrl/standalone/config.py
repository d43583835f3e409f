"""Typed views of the ``rllm.*`` sections the driver hands to ``backend.init_rollout_engine``.

They mirror the field names of rLLM's ``rllm.trainer.algorithms.config`` dataclasses, so backend
code reading ``algorithm_config.norm_adv_by_std_in_grpo`` or ``cf_config.should_mask(reason)``
works with either driver. ``estimator`` is a plain string here (rLLM's is a ``str`` enum, which
compares equal to the same string).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm_skyrl.records import DEFAULT_TRAJECTORY_NAME, TerminationReason, termination_value


def _section(config: DictConfig | None) -> dict[str, Any]:
    """A config section as a plain dict; a missing section reads as empty (all defaults)."""
    if config is None:
        return {}
    return OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else dict(config)


@dataclass
class RolloutCorrectionConfig:
    """Off-policy correction knobs (``rllm.algorithm.rollout_correction``)."""

    tis_mode: str | None = None
    bypass_mode: bool | None = None
    tis_cap: float = 2.0


@dataclass
class AlgorithmConfig:
    """``rllm.algorithm`` plus ``rllm.stepwise_advantage.mode``."""

    estimator: str = "grpo"
    estimator_map: dict[str, str] = field(default_factory=dict)
    loss_fn_map: dict[str, str] = field(default_factory=dict)  # from [estimator, loss_fn] map values
    stepwise_advantage_mode: str = "broadcast"
    norm_adv_by_std_in_grpo: bool = True
    use_precomputed_advantage: bool = False
    loss_fn: str | None = None
    loss_agg_mode: str | None = None
    lr_schedule: str = "constant"
    warmup_steps: int = -1
    warmup_steps_ratio: float = 0.0
    kl_beta: float = 0.0
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    @classmethod
    def from_config(
        cls, algorithm: DictConfig | None, stepwise_advantage_mode: str = "broadcast"
    ) -> AlgorithmConfig:
        raw = _section(algorithm)
        defaults = cls()
        # [estimator, loss_fn] values split as rLLM's AlgorithmConfig splits (estimator, loss_fn) tuples.
        by_role = raw.get("estimator_map") or {}
        return cls(
            estimator=raw.get("adv_estimator", defaults.estimator),
            estimator_map={role: v[0] if isinstance(v, list) else v for role, v in by_role.items()},
            loss_fn_map={role: v[1] for role, v in by_role.items() if isinstance(v, list)},
            stepwise_advantage_mode=stepwise_advantage_mode,
            norm_adv_by_std_in_grpo=raw.get("norm_adv_by_std_in_grpo", defaults.norm_adv_by_std_in_grpo),
            use_precomputed_advantage=raw.get(
                "use_precomputed_advantage", defaults.use_precomputed_advantage
            ),
            loss_fn=raw.get("loss_fn"),
            loss_agg_mode=raw.get("loss_agg_mode"),
            lr_schedule=raw.get("lr_schedule", defaults.lr_schedule),
            warmup_steps=raw.get("warmup_steps", defaults.warmup_steps),
            warmup_steps_ratio=raw.get("warmup_steps_ratio", defaults.warmup_steps_ratio),
            kl_beta=raw.get("kl_beta", defaults.kl_beta),
            eps_clip=raw.get("eps_clip", defaults.eps_clip),
            eps_clip_high=raw.get("eps_clip_high"),
            rollout_correction=RolloutCorrectionConfig(**(raw.get("rollout_correction") or {})),
        )


@dataclass
class CompactFilteringConfig:
    """Which termination reasons drop an episode from training (``rllm.compact_filtering``)."""

    enable: bool = False
    mask_max_prompt_length_exceeded: bool = False
    mask_max_response_length_exceeded: bool = False
    mask_env_done: bool = False
    mask_max_turns_exceeded: bool = False
    mask_timeout: bool = False
    mask_unknown: bool = False
    mask_error: bool = False

    @classmethod
    def from_config(cls, compact_filtering: DictConfig | None) -> CompactFilteringConfig:
        return cls(**_section(compact_filtering))

    def should_mask(self, reason: TerminationReason | str | None) -> bool:
        if not self.enable:
            return False
        value = TerminationReason(termination_value(reason)).value
        return bool(getattr(self, f"mask_{value}"))


@dataclass
class TransformConfig:
    """How episodes become trajectory groups (``rllm.transform``).

    ``broadcast`` is True in rLLM's only supported stepwise mode: one scalar reward per
    trajectory, taken from the last step when the workflow left ``Trajectory.reward`` unset.
    """

    impute_missing_names: bool = True
    default_traj_name: str = DEFAULT_TRAJECTORY_NAME
    drop_unnamed_traj: bool = False
    broadcast: bool = True

    @classmethod
    def from_config(cls, transform: DictConfig | None, broadcast: bool = True) -> TransformConfig:
        raw = _section(transform)
        return cls(
            impute_missing_names=raw.get("impute_missing_names", True),
            default_traj_name=raw.get("default_traj_name", DEFAULT_TRAJECTORY_NAME),
            drop_unnamed_traj=raw.get("drop_unnamed_traj", False),
            broadcast=broadcast,
        )


@dataclass
class RejectionSamplingConfig:
    """``rllm.rejection_sample``; this driver trains on every group, so only mode ``"none"`` runs."""

    mode: str = "none"
    min_trajs_per_group: int = 2
    min_partial_solve_tasks: int = 1
    filter_uniform_groups: bool = False

    @classmethod
    def from_config(cls, rejection_sample: DictConfig | None) -> RejectionSamplingConfig:
        raw = _section(rejection_sample)
        return cls(
            mode=raw.get("mode") or ("episode" if raw.get("enable", False) else "none"),
            min_trajs_per_group=raw.get("min_trajs_per_group", 2),
            min_partial_solve_tasks=raw.get("min_partial_solve_tasks", 1),
            filter_uniform_groups=raw.get("filter_uniform_groups", False),
        )
