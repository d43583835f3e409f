"""Metric names shared with rLLM's other backends, and the few the SkyRL backend adds.

rLLM's backends log ``train/{kl_sample_train_v1,kl_sample_train_v2,entropy,perplexity}``,
``progress/*``, ``time/*``, ``batch/*``, ``reward/*`` and ``val/*``. SkyRL's workers name the same
things differently (``policy_entropy``, ``policy_lr``, ...); ``worker_metrics`` renames them so a
dashboard built for one backend reads the other.
"""

from __future__ import annotations

from typing import Any

import torch

# Sampler-vs-trainer and policy-vs-reference KL, in the order dashboards and plots prefer them.
KL_KEYS = ("train/kl", "train/kl_sample_train_v1", "train/kl_sample_train_v2", "policy/kl")
_POLICY_NAMES = {
    "final_loss": "train/loss",
    "policy_loss": "train/policy_loss",
    "policy_entropy": "train/entropy",
    "policy_kl": "train/kl",
    "policy_lr": "progress/lr",
    "lr": "progress/lr",
    "loss": "train/loss",
    "response_length": "train/response_tokens",
}
_CRITIC_NAMES = {
    "critic_loss": "critic/value_loss",
    "final_loss": "critic/loss",
    "critic_lr": "critic/lr",
    "values_mean": "critic/values_mean",
}


def worker_metrics(role: str, metrics: dict[str, Any]) -> dict[str, float]:
    """SkyRL worker metrics -> our names; anything unmapped keeps its name under ``<role>/``."""
    names = _POLICY_NAMES if role == "policy" else _CRITIC_NAMES
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, int | float):
            name = (
                names.get(key)
                or f"{'train' if role == 'policy' else role}/{key.removeprefix('loss_metrics/')}"
            )
            out[name] = float(value)
    return out


def logprob_gap_metrics(batch: Any, loss_fn_outputs: list[dict[str, Any]]) -> dict[str, float]:
    """How far the trainer's logprobs are from the sampler's on the same tokens, before the update.

    A growing gap means rollout and training disagree (precision, attention implementation,
    stale weights); rLLM reports it as ``train/kl_sample_train_v{1,2}``.
    """
    gaps, train_logprobs = [], []
    for i, output in enumerate(loss_fn_outputs):
        trainer_T = torch.as_tensor(output.get("logprobs", []), dtype=torch.float32)
        n = trainer_T.numel()
        if n == 0:
            continue
        mask_T = batch["loss_mask"][i, -n:] > 0
        rollout_T = batch["rollout_logprobs"][i, -n:].float()
        gaps.append((rollout_T - trainer_T)[mask_T])
        train_logprobs.append(trainer_T[mask_T])
    if not gaps or not torch.cat(gaps).numel():
        return {}
    gap_N, train_N = torch.cat(gaps), torch.cat(train_logprobs)
    return {
        "train/kl_sample_train_v1": gap_N.mean().item(),
        "train/kl_sample_train_v2": 0.5 * gap_N.pow(2).mean().item(),
        "train/logprob_abs_diff/mean": gap_N.abs().mean().item(),
        "train/logprob_abs_diff/max": gap_N.abs().max().item(),
        "train/perplexity": torch.exp(-train_N.mean()).item(),
    }
