"""Each token's term of a SkyRL policy loss, recomputed on the driver for Tinker's ``elementwise_loss``.

SkyRL's policy worker returns per-row logprobs only. SkyRL's registered loss, run on them, is
``sum(l * loss_mask)`` with a per-token ``l`` independent of the mask, so its gradient with respect
to the mask is exactly ``l`` (one call, no copy of the formula). That holds for
``_MASK_GRADIENT_LOSSES`` but not under ``trainer.algorithm.off_policy_correction``, whose
sequence-level masks and ratios tie a token's term to its row; then there is no term (None).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from omegaconf import OmegaConf
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

from rllm_skyrl.data.batch_layout import right_aligned
from rllm_skyrl.run_config.losses import ResolvedLoss

_MASK_GRADIENT_LOSSES = ("regular", "importance_sampling", "cispo", "dppo")


class ElementwisePolicyLoss:
    """Per-token policy loss terms under ``algorithm``: the AlgorithmConfig the policy's workers hold,
    which its owner changes in place (and then calls ``forget_configs``)."""

    def __init__(self, algorithm: Any) -> None:
        self.algorithm = algorithm
        self._configs: dict[str, Any] = {}

    def forget_configs(self) -> None:
        self._configs.clear()

    def _config(self, resolved: ResolvedLoss) -> Any:
        """The policy's AlgorithmConfig with ``resolved``'s overrides merged as the worker merges them
        (OmegaConf, ``_forward_backward_micro``); None when the recomputation is not exact. Kept per
        override set: merging costs milliseconds a step."""
        from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import off_policy_correction_enabled

        key = f"{resolved.skyrl_loss_name}:{sorted(resolved.skyrl_config.items())!r}"
        if key not in self._configs:
            base = self.algorithm
            merged = OmegaConf.merge(OmegaConf.create(asdict(base)), OmegaConf.create(resolved.skyrl_config))
            config = type(base).from_dict_config(merged)
            exact = resolved.skyrl_loss_name in _MASK_GRADIENT_LOSSES and not off_policy_correction_enabled(
                config.off_policy_correction
            )
            self._configs[key] = config if exact else None
        return self._configs[key]

    def per_token(
        self, resolved: ResolvedLoss, batch: TrainingInputBatch, logprobs: list[list[float]]
    ) -> torch.Tensor | None:
        """Each token's term of SkyRL's policy loss (times ``loss_mask``), or None when not exact."""
        from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

        config = self._config(resolved)
        if config is None:
            return None
        loss_mask_BT = batch["loss_mask"].float()
        mask_BT = loss_mask_BT.clone().requires_grad_(True)
        loss, _ = PolicyLossRegistry.get(resolved.skyrl_loss_name)(
            right_aligned(logprobs, loss_mask_BT.shape[1]),
            batch["action_log_probs"].float(),
            batch["advantages"].float(),
            config=config,
            loss_mask=mask_BT,
            rollout_logprobs=batch.get("rollout_logprobs"),
        )
        (per_token_BT,) = torch.autograd.grad(loss, mask_BT)
        return per_token_BT * loss_mask_BT
