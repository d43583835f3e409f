"""Off-policy correction through SkyRL's own: which losses apply it, and bypass mode's decoupled losses.

rLLM's ``rollout_correction.tis_mode`` with ``tis_cap`` is SkyRL's
``trainer.algorithm.off_policy_correction`` (README, "Off-policy correction"): SkyRL's policy losses
weigh each token's term (or sequence's) by ``min(exp(old - rollout), cap)``, detached. In bypass mode
the batch's old log-probs are the sampler's, so that weight would be exactly 1; ``DecoupledLoss``
(registered in SkyRL's ``PolicyLossRegistry``) calls SkyRL's loss with the trainer's own log-probs,
detached, as the old ones: its ratio ``exp(logp - sg(logp))`` is 1 with the gradient of ``logp`` and
the weight is ``min(exp(sg(logp) - rollout), cap)``, verl's decoupled PPO with the current policy as
the proximal one. Only one optimizer step per batch keeps that policy the one before the update, so
the run config refuses bypass mode with several.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from rllm_skyrl.losses import ResolvedLoss

_DECOUPLED = "rllm_skyrl_decoupled:"

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
    return replace(loss, skyrl_loss_name=_DECOUPLED + str(loss.skyrl_loss_name))


def is_decoupled(skyrl_loss_name: str | None) -> bool:
    return bool(skyrl_loss_name) and skyrl_loss_name.startswith(_DECOUPLED)


@functools.cache
def _registered(name: str) -> Any:
    """SkyRL's loss ``name``, looked up once per process (a lookup syncs with Ray's store)."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    return PolicyLossRegistry.get(name)


class DecoupledLoss:
    """SkyRL's registered loss ``base``, with the trainer's own log-probs, detached, as the old ones;
    SkyRL's policy worker calls it as any registered loss (``_forward_backward_micro``)."""

    def __init__(self, base: str) -> None:
        self.base = base

    def __call__(
        self,
        log_probs: Any,
        old_log_probs: Any,
        advantages: Any,
        config: Any,
        loss_mask: Any = None,
        rollout_logprobs: Any = None,
    ) -> tuple[Any, dict[str, float]]:
        del old_log_probs  # the sampler's in bypass mode; before this batch's step, the trainer's are π_old
        return _registered(self.base)(
            log_probs,
            log_probs.detach(),
            advantages,
            config=config,
            loss_mask=loss_mask,
            rollout_logprobs=rollout_logprobs,
        )


def register(skyrl_loss_names: Iterable[str]) -> None:
    """Register the decoupled losses among ``skyrl_loss_names`` (once per Ray session); with Ray up,
    SkyRL's registry hands them to every worker that looks one up."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    available = set(PolicyLossRegistry.list_available())
    for name in skyrl_loss_names:
        if is_decoupled(name) and name not in available:
            PolicyLossRegistry.register(name, DecoupledLoss(name.removeprefix(_DECOUPLED)))
