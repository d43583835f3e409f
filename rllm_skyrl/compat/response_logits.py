"""Compute the policy's logits only where the loss reads them: the response window.

SkyRL's ``HFModelWrapper.forward`` runs the LM head, a log-softmax over the whole vocabulary
and (for the entropy metric) a softmax at every position of every sequence, then keeps the
last ``num_actions + 1`` positions. The prompt positions are thrown away, yet at a 49K
vocabulary they are a large share of a training step (SmolLM2-135M, 8 rows of 35 prompt and
64 response tokens: 7% of the forward-backward; the tiny quickstart model: 30%).

The patch asks the model for those positions only (transformers' ``logits_to_keep``) and then
computes the log-probs and the entropy with SkyRL's own functions, exactly as the original does
on them: the response's log-probs are bit-identical and the entropy's window is the same
(``test_compat.py`` checks both against the unpatched forward). Outside the window the
returned entropy is zero, as SkyRL's is at padded positions; SkyRL reads only the window.

The shortcut applies to the plain path: no sample packing, sequence parallelism, VLM inputs or
sample-support replay, and a model whose ``forward`` takes ``logits_to_keep``. Everything
else goes to SkyRL's forward unchanged. Applied on every platform: the waste is the same on GPU.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from typing import Any

import torch
import torch.nn.functional as F

from rllm_skyrl.compat.patch import Patch

_WRAPPER = "skyrl.backends.skyrl_train.workers.model_wrapper"


def _takes_logits_to_keep(wrapper: Any) -> bool:
    """Whether the wrapped causal LM (under PEFT's wrapper, if LoRA) can skip positions."""
    cached = getattr(wrapper, "_rllm_skyrl_logits_to_keep", None)
    if cached is None:
        model = wrapper.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        cached = "logits_to_keep" in inspect.signature(base.forward).parameters
        wrapper._rllm_skyrl_logits_to_keep = cached
    return cached


def _window_forward(
    wrapper: Any,
    sequences: torch.Tensor,
    num_actions: int,
    attention_mask: torch.Tensor,
    temperature: float,
    return_output: bool,
    compute_entropy: bool,
    entropy_requires_grad: bool,
):
    from skyrl.backends.skyrl_train.utils.torch_utils import logprobs_from_logits

    width = int(num_actions) + 1  # the positions SkyRL's forward keeps; the last one predicts nothing
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    output = wrapper.model(
        sequences, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=width
    )
    logits_BKV = output["logits"]
    logits_BKV.div_(temperature)
    labels_BK = torch.roll(sequences, shifts=-1, dims=1)[:, -width:]
    action_log_probs = logprobs_from_logits(logits_BKV, labels_BK, inplace_backward=True)[:, :-1]
    if compute_entropy:
        entropy_BK = wrapper.chunked_entropy_from_logits_fn(
            logits_BKV,
            requires_grad=entropy_requires_grad,
            attention_mask=attention_mask[:, -width:],
            chunk_size=wrapper.logprobs_chunk_size,
        )
        output["entropy"] = F.pad(entropy_BK, (sequences.shape[1] - width, 0))
    return (action_log_probs, output) if return_output else action_log_probs


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
        return _window_forward(
            self,
            sequences,
            num_actions,
            attention_mask,
            temperature,
            return_output,
            compute_entropy,
            entropy_requires_grad,
        )

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
