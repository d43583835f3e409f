"""Compute the policy's logits only where the loss reads them, and a shared prompt only once.

SkyRL's ``HFModelWrapper.forward`` runs the LM head, a full-vocabulary log-softmax and (for the
entropy metric) a softmax at every position, then keeps the last ``num_actions + 1``. At a 49K
vocabulary the discarded prompt positions are a large share of a step (SmolLM2-135M, 8 rows of 35
prompt and 64 response tokens: 7% of the forward-backward; the tiny quickstart model: 30%).

Here the model computes those positions only (transformers' ``logits_to_keep``) and SkyRL's own
functions give the log-probs and entropy on them: the response's log-probs are bit-identical and
the entropy's window the same (``test_compat.py`` checks both against the unpatched forward).
Outside the window the entropy is zero, as SkyRL's is at padded positions; SkyRL reads only the
window. Rows sharing their context (a prompt's samples) go through ``context_packing`` where that
pays: the same logits up to float rounding, so bit-identical holds without shared contexts.

Only the plain path takes the shortcut (no sample packing, sequence parallelism, VLM inputs or
sample-support replay; a model whose ``forward`` takes ``logits_to_keep``); the rest goes to
SkyRL's forward unchanged.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from typing import Any

import torch
import torch.nn.functional as F

from rllm_skyrl.compat import context_packing
from rllm_skyrl.compat.patch import Patch

_WRAPPER = "skyrl.backends.skyrl_train.workers.model_wrapper"
# Elements per log-sum-exp call (1 MB in fp32): fewer calls than one per row, still in cache.
LOGSUMEXP_CHUNK = 1 << 18


def _base_model(wrapper: Any) -> Any:
    """The wrapped causal LM, under PEFT's wrapper if LoRA."""
    model = wrapper.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _takes_logits_to_keep(wrapper: Any) -> bool:
    if not hasattr(wrapper, "_rllm_skyrl_logits_to_keep"):
        forward = _base_model(wrapper).forward
        wrapper._rllm_skyrl_logits_to_keep = "logits_to_keep" in inspect.signature(forward).parameters
    return wrapper._rllm_skyrl_logits_to_keep


def _pairs_per_token(wrapper: Any) -> float | None:
    """None: rows are not packed."""
    if not hasattr(wrapper, "_rllm_skyrl_pairs_per_token"):
        wrapper._rllm_skyrl_pairs_per_token = context_packing.pairs_per_token(_base_model(wrapper))
    return wrapper._rllm_skyrl_pairs_per_token


def _label_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """SkyRL's ``logprobs_from_logits``, with its fallback's log-sum-exp taken over chunks of rows.

    Without flash-attn's CUDA kernel SkyRL takes one ``logsumexp`` per row (to bound memory): over
    a window of a few positions, a batch's worth of tiny kernels, several times the chunked time
    (bench/README.md: 'A step'). Chunks of ``LOGSUMEXP_CHUNK`` elements bound memory the same way and
    give the same values bit for bit: each row's reduction is unchanged.
    """
    from skyrl.backends.skyrl_train.utils.torch_utils import (
        FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE,
        logprobs_from_logits,
    )

    if logits.dtype not in (torch.float32, torch.float64) or (
        FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE and logits.is_cuda
    ):
        return logprobs_from_logits(logits, labels, inplace_backward=True)
    rows = max(1, LOGSUMEXP_CHUNK // logits[0].numel())
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.cat([torch.logsumexp(chunk, dim=-1) for chunk in logits.split(rows)])


def _logits_for_the_response_only() -> None:
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper

    original = HFModelWrapper.forward
    if getattr(original, "_rllm_skyrl_patched", False):
        return

    @functools.wraps(original)
    def forward(
        self,
        sequences,
        num_actions,
        attention_mask=None,
        temperature=1.0,
        return_output=False,
        compute_entropy=False,
        entropy_requires_grad=True,
        **kwargs,
    ):
        if isinstance(num_actions, list) and len(num_actions) == 1:
            num_actions = num_actions[0]
        plain = (
            isinstance(num_actions, numbers.Integral)
            and attention_mask is not None
            and not self.is_vlm
            and not self.remove_microbatch_padding
            and self.sequence_parallel_size == 1
            and not kwargs.get("enable_sample_support_replay", False)
            and _takes_logits_to_keep(self)
        )
        if not plain:
            return original(
                self,
                sequences,
                num_actions,
                attention_mask=attention_mask,
                temperature=temperature,
                return_output=return_output,
                compute_entropy=compute_entropy,
                entropy_requires_grad=entropy_requires_grad,
                **kwargs,
            )
        width = int(num_actions) + 1  # the positions SkyRL's forward keeps; the last one predicts nothing
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        packed = context_packing.packed_window_logits(
            self.model, sequences, attention_mask, position_ids, width, _pairs_per_token(self)
        )
        if packed is not None:
            logits_BKV, output = packed
        else:
            output = self.model(
                sequences, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=width
            )
            logits_BKV = output["logits"]
        logits_BKV.div_(temperature)
        labels_BK = torch.roll(sequences, shifts=-1, dims=1)[:, -width:]
        action_log_probs = _label_logprobs(logits_BKV[:, :-1], labels_BK[:, :-1])
        if compute_entropy:
            entropy_BK = self.chunked_entropy_from_logits_fn(
                logits_BKV,
                requires_grad=entropy_requires_grad,
                attention_mask=attention_mask[:, -width:],
                chunk_size=self.logprobs_chunk_size,
            )
            output["entropy"] = F.pad(entropy_BK, (sequences.shape[1] - width, 0))
        return (action_log_probs, output) if return_output else action_log_probs

    forward._rllm_skyrl_patched = True
    HFModelWrapper.forward = forward


PATCHES: tuple[Patch, ...] = (
    Patch(
        "response_logits",
        (
            _WRAPPER,
            "HFModelWrapper.forward",
            "output = self.model(sequences_fwd, attention_mask=attention_mask_fwd, "
            "position_ids=position_ids_fwd)",
        ),
        _logits_for_the_response_only,
    ),
)


def apply() -> None:
    """Install the patch (idempotent). SkyRL's worker modules import flash-attn: stub it first."""
    for patch in PATCHES:
        patch.install()
