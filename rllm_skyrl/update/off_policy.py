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
from typing import Any

from rllm_skyrl.run_config.losses import DECOUPLED_PREFIX, is_decoupled


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
            PolicyLossRegistry.register(name, DecoupledLoss(name.removeprefix(DECOUPLED_PREFIX)))
