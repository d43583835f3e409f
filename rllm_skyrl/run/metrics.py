"""Metric names and definitions shared with rLLM's tinker backend, and the few the SkyRL backend adds.

Definitions are tinker's (``rllm/trainer/tinker/tinker_metrics_utils.py``), so a dashboard compares
backends; ``worker_metrics`` renames SkyRL's. SkyRL's true entropy over the vocabulary is
``train/policy_entropy``: rLLM's ``train/entropy`` is the sampled tokens' negative log-likelihood.

Off-policy correction goes under the names rLLM's verl backend logs (``rollout_correction/*``) with
SkyRL's definitions (README, "Off-policy correction"): verl's ``rollout_is_mean`` is of the capped
weights and its sequence-level max of sequence ratios, SkyRL's are of the uncapped token ratio.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from rllm_skyrl.data.batch_layout import right_aligned

# Sampler-vs-trainer and policy-vs-reference KL, in the order dashboards and plots prefer them.
KL_KEYS = ("train/kl", "train/kl_sample_train_v1", "train/kl_sample_train_v2", "policy/kl")
_POLICY_NAMES = {
    "final_loss": "train/loss",
    "policy_loss": "train/policy_loss",
    "policy_entropy": "train/policy_entropy",
    "policy_kl": "train/kl",
    "policy_lr": "progress/lr",
    "lr": "progress/lr",
    "loss": "train/loss",
    "response_length": "train/response_tokens",
}
_CORRECTION_NAMES = {
    "loss_metrics/is_ratio_mean": "rollout_correction/rollout_is_mean",
    "loss_metrics/is_ratio_max": "rollout_correction/rollout_is_max",
    "loss_metrics/tis_token_clip_high_ratio": "rollout_correction/rollout_is_ratio_fraction_high",
    "loss_metrics/tis_seq_clip_high_ratio": "rollout_correction/rollout_is_ratio_fraction_high",
}
_CRITIC_NAMES = {
    "critic_loss": "critic/value_loss",
    "final_loss": "critic/loss",
    "critic_lr": "critic/lr",
    "values_mean": "critic/values_mean",
}


def worker_metrics(role: str, metrics: dict[str, Any]) -> dict[str, float]:
    """SkyRL worker metrics -> our names; anything unmapped keeps its name under ``<role>/``."""
    names = {**_POLICY_NAMES, **_CORRECTION_NAMES} if role == "policy" else _CRITIC_NAMES
    prefix = "train" if role == "policy" else role
    return {
        names.get(key) or f"{prefix}/{key.removeprefix('loss_metrics/')}": float(value)
        for key, value in metrics.items()
        if isinstance(value, int | float)
    }


def logprob_gap_metrics(batch: Any, loss_fn_outputs: list[dict[str, Any]]) -> dict[str, float]:
    """How far the trainer's logprobs are from the sampler's on the same tokens, before the update.

    A growing gap means rollout and training disagree (precision, attention implementation,
    stale weights).
    """
    rows = [output.get("logprobs", []) for output in loss_fn_outputs]
    width = batch["loss_mask"].shape[1]
    lengths_B = torch.tensor([len(row) for row in rows])
    # Each row's logprobs are its last len(row) tokens; of those, the loss-masked ones count.
    counted_BT = (torch.arange(width) >= width - lengths_B[:, None]) & (batch["loss_mask"][: len(rows)] > 0)
    if not counted_BT.any():
        return {}
    rollout_BT = batch["rollout_logprobs"][: len(rows)].float()
    gap_N = (rollout_BT - right_aligned(rows, width))[counted_BT]
    entropy = -rollout_BT[counted_BT].mean().item()
    return {
        "train/kl_sample_train_v1": gap_N.abs().mean().item(),
        "train/kl_sample_train_v2": 0.5 * gap_N.pow(2).mean().item(),
        "train/entropy": entropy,
        "train/perplexity": float(torch.exp(torch.tensor(entropy))),
        "train/logprob_abs_diff/mean": gap_N.abs().mean().item(),
        "train/logprob_abs_diff/max": gap_N.abs().max().item(),
    }


# Counts add up over the calls of one step; everything else is a per-call figure.
_SUMMED = frozenset(
    {
        "batch/num_rows",
        "batch/num_pad_rows",
        "batch/dropped_malformed_sequences",
        "batch/filtered_zero_variance_groups",
        "batch/skipped_update",
        "batch/steps_restored_from_rollouts",
        "batch/steps_without_tokens",
        "perf/rollout_tokens",
    }
)


class StepMetrics:
    """Metrics of one optimizer step, gathered over however many calls make it up (rLLM's
    fully-async mode forward-backwards a step's groups in chunks before one update): ``time/*`` and
    counts are summed, ``*/max`` and ``*/min`` (and SkyRL's ``*_max``, ``*_min``) keep the extreme,
    everything else is averaged."""

    def __init__(self) -> None:
        self._samples: dict[str, list[float]] = defaultdict(list)

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._samples[f"time/{name}"].append(time.perf_counter() - start)

    def add(self, metrics: Mapping[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._samples[key].append(float(value))

    def publish_step(self, trainer_state: Any) -> dict[str, float]:
        """The step's metrics as rLLM's tinker backend reports them, with the trainer's timers."""
        metrics = {}
        for key, values in self._samples.items():
            if key.startswith("time/") or key in _SUMMED:
                metrics[key] = sum(values)
            elif key.endswith(("/max", "_max")):
                metrics[key] = max(values)
            elif key.endswith(("/min", "_min")):
                metrics[key] = min(values)
            else:
                metrics[key] = sum(values) / len(values)
        for name, seconds in getattr(trainer_state, "timing_dict", {}).items():
            metrics.setdefault(f"time/{name}", seconds)
        if "time/generate" in metrics and "perf/rollout_tokens" in metrics:
            metrics["perf/rollout_tokens_per_s"] = metrics["perf/rollout_tokens"] / max(
                metrics["time/generate"], 1e-9
            )
        step = trainer_state.global_step
        metrics |= {"progress/batch": step, "progress/epoch": getattr(trainer_state, "epoch", 0)}
        total = getattr(trainer_state, "total_steps", 0) or 0
        if total > 0:
            metrics["progress/done_frac"] = step / total
        return metrics

    def clear(self) -> None:
        self._samples.clear()
