"""Keep tied input and output embeddings tied through SkyRL's FSDP2 set-up.

SkyRL's ``FSDPStrategy._fsdp_init_model`` moves the loaded model to the meta device before
sharding it, and ``Module.to("meta")`` gives every module its own new parameter: the one tensor
``lm_head.weight`` and ``model.embed_tokens.weight`` shared becomes two, and the trainer trains an
untied head. No server can follow (vLLM builds such a model tied, and the exported checkpoint
still says ``tie_word_embeddings=true``): rollout and trainer logprobs drift apart every step.

Re-tied with transformers' own ``tie_weights`` over the pairs it tied at load time (a checkpoint
loaded untied stays untied), at the two places SkyRL's set-up splits them:

- before ``apply_fsdp2`` (after the meta move), so FSDP2 shards the shared parameter once and
  gathers one tensor for both modules in every forward;
- after ``fsdp2_load_full_state_dict``, whose ``load_state_dict(assign=True)`` hands each name
  its own new tensor again (FSDP2 re-shares them only at the first forward, after SkyRL has
  already built the optimizer over both), so the optimizer sees the shared parameter once.
"""

from __future__ import annotations

import functools

import torch

from rllm_skyrl.compat.patch import Patch

_STRATEGY = "skyrl.backends.skyrl_train.distributed.fsdp_strategy"


def retie(model: torch.nn.Module) -> None:
    """Share again the parameters transformers tied at load time (a no-op for untied models)."""
    tie_weights = getattr(model, "tie_weights", None)
    if callable(tie_weights) and getattr(model, "all_tied_weights_keys", None):
        tie_weights(recompute_mapping=False)


def _retie_around_sharding() -> None:
    from skyrl.backends.skyrl_train.distributed import fsdp_strategy

    shard, load = fsdp_strategy.apply_fsdp2, fsdp_strategy.fsdp2_load_full_state_dict
    if getattr(shard, "_rllm_skyrl_patched", False):
        return

    @functools.wraps(shard)
    def apply_fsdp2(model, *args, **kwargs):
        retie(model)
        return shard(model, *args, **kwargs)

    @functools.wraps(load)
    def fsdp2_load_full_state_dict(model, *args, **kwargs):
        loaded = load(model, *args, **kwargs)
        retie(model)
        return loaded

    apply_fsdp2._rllm_skyrl_patched = True
    fsdp_strategy.apply_fsdp2 = apply_fsdp2
    fsdp_strategy.fsdp2_load_full_state_dict = fsdp2_load_full_state_dict


PATCHES: tuple[Patch, ...] = (
    Patch(
        "retie_embeddings",
        (_STRATEGY, "FSDPStrategy._fsdp_init_model", 'module.to(torch.device("meta"))'),
        _retie_around_sharding,
    ),
)


def apply() -> None:
    """Install the patch (idempotent). SkyRL's worker modules import flash-attn: stub it first."""
    for patch in PATCHES:
        patch.install()
