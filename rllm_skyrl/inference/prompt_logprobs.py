"""Prompt-token logprobs, as vLLM's ``prompt_logprobs`` (what ``echo`` with ``logprobs`` reports).

Token i's logprob is ``log_softmax(logits at i - 1)[token i]`` from the raw logits (no temperature,
as vLLM computes prompt logprobs), floored like sampled ones; the first token has no context to be
scored from, so its logprob and alternatives are None. A teacher scoring a student's sample for
distillation reads these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rllm_skyrl.inference.sampling import reportable


@dataclass(frozen=True)
class PromptLogprobs:
    """One entry per prompt token; ``top`` (k best alternatives per token) only when k > 0."""

    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None] | None


def score_prompt(logits_LV: torch.Tensor, prompt_ids: list[int], top: int) -> PromptLogprobs:
    """Score ``prompt_ids`` from ``logits_LV``, the model's logits at the prompt's own positions."""
    if logits_LV.shape[0] != len(prompt_ids):
        raise ValueError(f"{logits_LV.shape[0]} logit rows for a prompt of {len(prompt_ids)} tokens")
    logprobs_LV = torch.log_softmax(logits_LV[:-1].float(), dim=-1)
    targets_L = torch.tensor(prompt_ids[1:], dtype=torch.long)
    chosen = reportable(logprobs_LV.gather(1, targets_L.unsqueeze(1)).squeeze(1)).tolist()
    alternatives = None
    if top > 0:
        values, indices = logprobs_LV.topk(top, dim=-1)
        pairs = zip(indices.tolist(), reportable(values).tolist(), strict=True)
        alternatives = [None, *(list(zip(i, v, strict=True)) for i, v in pairs)]
    return PromptLogprobs([None, *chosen], alternatives)
