"""Tinker loss names and configs -> what SkyRL's workers take, with the role check in one place.

Facts from SkyRL 0.4 this table encodes (``skyrl/backends/skyrl_train/utils/ppo_utils.py``):

- ``ppo`` is SkyRL's ``regular`` loss. ``ppo_policy_loss`` asserts ``policy_loss_type`` is
  ``regular``/``dual_clip`` and switches to dual clip on it, so every policy config pins
  ``policy_loss_type`` to the loss asked for, whatever ``trainer.algorithm.policy_loss_type`` says.
- Tinker clip thresholds are absolute ratio bounds (0.8, 1.2); SkyRL's are offsets from 1
  (``eps_clip_low=0.2``, ``eps_clip_high=0.2``). ``gspo`` clips a sequence-level ratio (the
  geometric mean of the token ratios) with the same offsets as ``ppo``, and is written for
  ``sequence_mean`` reduction (``loss_reduction`` in its config, which SkyRL's loss checks).
  ``cispo`` reads its own nested offsets; ``dppo`` masks by probability divergence and has no ratio
  clip. The worker merges ``loss_fn_config`` into its ``AlgorithmConfig`` with OmegaConf, so nested
  keys land on the nested dataclasses.
- The critic takes no ``loss_fn``: its loss is ``ppo_critic_loss`` reading ``value_clip`` from the
  worker's algorithm config, which only ``WorkerDispatch.set_algorithm_config`` changes. That
  setting persists on the workers, so when ``value_clip`` is absent here the caller should set its
  configured default again (as SkyRL's own Tinker backend does).

Keys left out keep the run's ``trainer.algorithm`` values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

POLICY = "policy"
CRITIC = "critic"


@dataclass(frozen=True)
class _Option:
    """One accepted config key: where it lands in SkyRL's AlgorithmConfig and how it converts."""

    path: tuple[str, ...]
    convert: Callable[[str, Any], Any]


@dataclass(frozen=True)
class _LossSpec:
    skyrl_name: str | None
    role: str
    options: Mapping[str, _Option] = field(default_factory=dict)
    uses_advantages: bool = True
    fixed: Mapping[str, Any] = field(default_factory=dict)  # SkyRL settings the loss is written for


@dataclass(frozen=True)
class ResolvedLoss:
    """A loss request checked against its role, in SkyRL's terms.

    Policy: ``dispatch.forward_backward(role, batch, **resolved.dispatch_kwargs())``.
    Critic (``skyrl_loss_name is None``): ``dispatch.set_algorithm_config("critic",
    **resolved.skyrl_config)`` then ``dispatch.forward_backward("critic", batch)``.
    """

    role: str
    loss_fn: str
    skyrl_loss_name: str | None
    skyrl_config: dict[str, Any]
    uses_advantages: bool

    @property
    def trains_critic(self) -> bool:
        return self.skyrl_loss_name is None

    def dispatch_kwargs(self) -> dict[str, Any]:
        if self.trains_critic:
            return {}
        return {"loss_fn": self.skyrl_loss_name, "loss_fn_config": self.skyrl_config}


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _low_threshold_to_offset(name: str, value: Any) -> float:
    value = _number(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"{name} is an absolute ratio bound in [0, 1] (Tinker's default is 0.8), got {value}"
        )
    return round(1.0 - value, 12)  # 0.8 -> 0.2, not 0.19999999999999996


def _high_threshold_to_offset(name: str, value: Any) -> float:
    value = _number(name, value)
    if value < 1.0:
        raise ValueError(f"{name} is an absolute ratio bound >= 1 (Tinker's default is 1.2), got {value}")
    return round(value - 1.0, 12)


def _positive(name: str, value: Any) -> float:
    value = _number(name, value)
    if value <= 0.0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _value_clip(name: str, value: Any) -> float | None:
    if value is None:
        return None  # SkyRL's ppo_critic_loss: no clipping
    value = _number(name, value)
    if value < 0.0:
        raise ValueError(f"{name} must be >= 0 (or None for no clipping), got {value}")
    return value


def _one_of(*choices: str) -> Callable[[str, Any], str]:
    def convert(name: str, value: Any) -> str:
        if value not in choices:
            raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        return value

    return convert


_RATIO_CLIP = {
    "clip_low_threshold": _Option(("eps_clip_low",), _low_threshold_to_offset),
    "clip_high_threshold": _Option(("eps_clip_high",), _high_threshold_to_offset),
}
_LOSSES: dict[str, _LossSpec] = {
    "ppo": _LossSpec("regular", POLICY, _RATIO_CLIP),
    "importance_sampling": _LossSpec("importance_sampling", POLICY),
    "gspo": _LossSpec("gspo", POLICY, _RATIO_CLIP, fixed={"loss_reduction": "sequence_mean"}),
    "cispo": _LossSpec(
        "cispo",
        POLICY,
        {
            "clip_low_threshold": _Option(("cispo", "cispo_eps_clip_low"), _low_threshold_to_offset),
            "clip_high_threshold": _Option(("cispo", "cispo_eps_clip_high"), _high_threshold_to_offset),
            "cispo_anchor": _Option(("cispo", "cispo_anchor"), _one_of("old", "rollout")),
        },
    ),
    "dppo": _LossSpec(
        "dppo",
        POLICY,
        {
            "delta_low": _Option(("dppo", "delta_low"), _positive),
            "delta_high": _Option(("dppo", "delta_high"), _positive),
            "dppo_type": _Option(("dppo", "dppo_type"), _one_of("binary_tv", "binary_kl")),
        },
    ),
    "cross_entropy": _LossSpec("cross_entropy", POLICY, uses_advantages=False),
    "ppo_critic": _LossSpec(
        None, CRITIC, {"value_clip": _Option(("value_clip",), _value_clip)}, uses_advantages=False
    ),
}
LOSS_NAMES = tuple(_LOSSES)
POLICY_LOSS_NAMES = tuple(name for name, spec in _LOSSES.items() if spec.role == POLICY)


def accepted_config_keys(loss_fn: str) -> tuple[str, ...]:
    return tuple(_LOSSES[loss_fn].options)


def resolve_loss(role: str, loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None) -> ResolvedLoss:
    """Check ``loss_fn`` against the model role (``ppo`` on a critic is ``ppo_critic``) and translate
    its config to SkyRL's keys."""
    if role not in (POLICY, CRITIC):
        raise ValueError(f"unknown model role {role!r}; losses train 'policy' or 'critic' models")
    if loss_fn not in _LOSSES:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; accepted: {list(LOSS_NAMES)}")
    if role == CRITIC and loss_fn not in ("ppo", "ppo_critic"):
        raise ValueError(f"the critic trains with loss_fn='ppo_critic' (or 'ppo'), got {loss_fn!r}")
    if role == POLICY and loss_fn == "ppo_critic":
        raise ValueError(
            "loss_fn='ppo_critic' trains a value head: use it on the critic; "
            f"policy losses: {list(POLICY_LOSS_NAMES)}"
        )
    name = "ppo_critic" if role == CRITIC else loss_fn
    spec = _LOSSES[name]
    skyrl_config: dict[str, Any] = {} if spec.skyrl_name is None else {"policy_loss_type": spec.skyrl_name}
    skyrl_config.update(spec.fixed)
    for key, value in (loss_fn_config or {}).items():
        option = spec.options.get(key)
        if option is None:
            accepted = f"accepted keys: {list(spec.options)}" if spec.options else "it accepts no config keys"
            raise ValueError(f"loss_fn {name!r} does not accept config key {key!r}; {accepted}")
        node = skyrl_config
        for part in option.path[:-1]:
            node = node.setdefault(part, {})
        node[option.path[-1]] = option.convert(f"loss_fn {name!r}: {key}", value)
    return ResolvedLoss(role, name, spec.skyrl_name, skyrl_config, spec.uses_advantages)


# Off-policy correction per loss (the weighting itself runs in rllm_skyrl.update.off_policy).
DECOUPLED_PREFIX = "rllm_skyrl_decoupled:"

# Tinker losses whose SkyRL loss never applies off-policy correction, or whose ratio already is one.
_UNCORRECTED = {
    "cross_entropy": "SkyRL's cross_entropy is supervised: no ratio, no advantages, no off-policy correction",
    "importance_sampling": (
        "SkyRL's importance_sampling applies no off-policy correction (its own ratio is the uncapped pi/old)"
    ),
    "dppo": (
        "dppo takes its ratio and its mask against the rollout log-probs already (the sampler is "
        "its behaviour policy), so TIS would weigh the same gap twice"
    ),
}
_ROLLOUT_ANCHORED_CISPO = (
    "cispo with cispo_anchor='rollout' takes its ratio against the rollout log-probs already, so "
    "TIS would weigh the same gap twice (SkyRL's cispo refuses the pair)"
)


def uncorrected_reason(loss: ResolvedLoss, default_cispo_anchor: str = "old") -> str | None:
    """Why SkyRL's off-policy correction cannot apply to ``loss``; None when it does.

    ``default_cispo_anchor``: the run's ``trainer.algorithm.cispo.cispo_anchor``.
    """
    if loss.loss_fn == "cispo":
        anchor = loss.skyrl_config.get("cispo", {}).get("cispo_anchor", default_cispo_anchor)
        return _ROLLOUT_ANCHORED_CISPO if anchor == "rollout" else None
    return _UNCORRECTED.get(loss.loss_fn)


def decoupled(loss: ResolvedLoss) -> ResolvedLoss:
    """``loss`` computed by its decoupled variant (same SkyRL config: ``policy_loss_type`` stays the
    base loss, which SkyRL's ppo loss asserts)."""
    return replace(loss, skyrl_loss_name=DECOUPLED_PREFIX + str(loss.skyrl_loss_name))


def is_decoupled(skyrl_loss_name: str | None) -> bool:
    return bool(skyrl_loss_name) and skyrl_loss_name.startswith(DECOUPLED_PREFIX)
