"""LoRA settings: tinker's keys checked and turned into SkyRL's ``trainer.policy.model.lora``.

Targets come from the model's structure, read on the meta device (no weights loaded): every linear
layer inside an attention block (``train_attn``) or an MLP / mixture-of-experts block
(``train_mlp``), by the block's class name. Embeddings (``lm_head``, the input embedding) are never
targeted: SkyRL hands the adapter to vLLM, which adapts them for some architectures only (those
declaring ``embedding_modules``) and not when ``lm_head`` is tied, so such a run could not be
served on GPUs. A LoRA policy may run next to a fully trained critic, but LoRA on the critic is
refused (PEFT would freeze its fresh value head); the reference is always the frozen base (SkyRL 0.4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rllm_skyrl.run_config.bridge import disagreement
from rllm_skyrl.run_config.tree import select

ALL_LINEAR = "all-linear"
_POLICY = "trainer.policy.model.lora."
# Substrings of a block's class name (lower case) that say what its linear layers do.
_ATTENTION_BLOCKS = ("attention", "attn")
_MLP_BLOCKS = ("mlp", "moe", "expert", "feedforward", "ffn")
_EMBEDDINGS = ("unembed", "embed")


@dataclass(frozen=True)
class LoraSettings:
    """The policy's LoRA (SkyRL's workers read theirs from the config). ``rank == 0``: full fine-tuning."""

    rank: int = 0
    alpha: float = 16
    sync_path: str | None = None

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def module_kinds(model_path: str) -> dict[str, str]:
    """``{module name: kind}`` for every layer PEFT's LoRA can wrap, without loading weights: ``attn``,
    ``mlp``, ``unembed``, ``embed``, or ``other`` (a linear layer outside both, e.g. a vision projector)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    modules = dict(model.named_modules())
    output, embed = model.get_output_embeddings(), model.get_input_embeddings()
    kinds: dict[str, str] = {}
    for name, module in modules.items():
        if module is output:
            kinds[name] = "unembed"
        elif module is embed:
            kinds[name] = "embed"
        elif isinstance(module, torch.nn.Linear | Conv1D):
            kinds[name] = _block_kind(name, modules)
    return kinds


def _block_kind(name: str, modules: dict[str, Any]) -> str:
    """The kind of the innermost attention or MLP block that holds ``name``, else ``other``."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        block = type(modules[".".join(parts[:depth])]).__name__.lower()
        if any(word in block for word in _ATTENTION_BLOCKS):
            return "attn"
        if any(word in block for word in _MLP_BLOCKS):
            return "mlp"
    return "other"


def targets_for(kinds: dict[str, str], wanted: Sequence[str]) -> tuple[str, ...]:
    """PEFT ``target_modules`` covering exactly the layers of the ``wanted`` kinds: leaf names
    (``q_proj``), but full names where a leaf name is shared with a layer that must stay frozen
    (GPT-2's ``c_proj`` is in both attention and MLP)."""
    chosen = [name for name, kind in kinds.items() if kind in wanted]
    frozen_leaves = {name.rsplit(".", 1)[-1] for name, kind in kinds.items() if kind not in wanted}
    targets = set()
    for name in chosen:
        leaf = name.rsplit(".", 1)[-1]
        targets.add(name if leaf in frozen_leaves else leaf)
    return tuple(sorted(targets))


def matched_modules(target_modules: str | Sequence[str], names: Sequence[str]) -> list[str]:
    """The module names PEFT would wrap for ``target_modules`` (PEFT's own matching rule)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    wanted = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(target_modules=wanted)
    return [name for name in names if check_target_module_exists(config, name)]


def resolve_lora(
    cfg: Any, overrides: dict[str, Any], model_path: str, *, inspect: bool = True
) -> LoraSettings:
    """Check the LoRA keys and write the policy's target modules into SkyRL's ``overrides``.
    ``inspect=False`` (``rllm-skyrl plan``, whose model may not be on this machine) tolerates a model
    whose config cannot be read, unless the targets need it."""
    _refuse_critic_and_ref_lora(overrides)
    rank = overrides.get(_POLICY + "rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"model.lora_rank={rank!r}: must be an integer >= 0 (0 = full fine-tuning)")
    explicit = _explicit_targets(cfg, overrides)
    switches = {key: select(cfg, key, True) for key in ("model.train_attn", "model.train_mlp")}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: must be true or false")
    if rank == 0:
        asked = [f"{key}=false" for key, on in switches.items() if not on]
        asked += [f"model.lora_target_modules={explicit!r}"] if explicit is not None else []
        if asked:
            raise ValueError(
                f"{', '.join(asked)}: model.lora_rank=0 trains every weight (no LoRA adapters); "
                "set model.lora_rank > 0 for LoRA, or drop it"
            )
        return LoraSettings()
    alpha = overrides.get(_POLICY + "alpha", 16)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
        raise ValueError(
            f"model.lora_alpha={alpha!r}: must be a number > 0 (adapters are scaled by alpha/rank)"
        )
    dropout = overrides.get(_POLICY + "dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ValueError(f"model.lora_dropout={dropout!r}: must be in [0, 1)")
    targets = _targets(
        model_path, explicit, switches["model.train_attn"], switches["model.train_mlp"], inspect
    )
    overrides[_POLICY + "target_modules"] = targets if isinstance(targets, str) else list(targets)
    # The servers read the adapter from this path: absolute, so their working directory does not
    # matter; by default in the run's sync directory, the one tree this package's servers load from.
    default = Path(overrides.get("trainer.ckpt_path") or ".") / "sync" / "lora"
    sync_path = str(Path(overrides.get(_POLICY + "lora_sync_path") or default).resolve())
    overrides[_POLICY + "lora_sync_path"] = sync_path
    return LoraSettings(rank=rank, alpha=alpha, sync_path=sync_path)


def _refuse_critic_and_ref_lora(overrides: dict[str, Any]) -> None:
    reasons = {
        "critic": "LoRA here trains the policy only (model.lora_rank); PEFT would freeze the critic's "
        "freshly initialised value head, so the critic trains all its weights: set it to 0",
        "ref": "SkyRL's reference worker never reads it (the reference is the frozen base model, as "
        "LoRA needs); set it to 0",
    }
    for role, why in reasons.items():
        rank = overrides.get(f"trainer.{role}.model.lora.rank") or 0
        if rank:
            raise ValueError(f"skyrl.trainer.{role}.model.lora.rank={rank}: {why}")


def _targets(
    model_path: str, explicit: str | tuple[str, ...] | None, train_attn: bool, train_mlp: bool, inspect: bool
) -> str | tuple[str, ...]:
    """The modules to adapt: ``explicit`` ones checked against the model, else the asked kinds."""
    if explicit is not None and not (train_attn and train_mlp):
        raise ValueError(
            "model.lora_target_modules names the adapted modules itself; leave model.train_attn and "
            "model.train_mlp at true, or drop model.lora_target_modules"
        )
    if not (train_attn or train_mlp):
        raise ValueError(
            "model.train_attn=false and model.train_mlp=false leave LoRA nothing to adapt: set one of "
            "them to true (or model.lora_rank=0 for full fine-tuning)"
        )
    try:
        kinds = module_kinds(model_path)
    except (OSError, ValueError) as error:
        if inspect:
            raise ValueError(
                f"model.path={model_path!r}: cannot read its config to place LoRA: {error}"
            ) from error
        if explicit is None and not (train_attn and train_mlp):
            raise ValueError(
                "model.train_attn / model.train_mlp: placing LoRA needs the model's config, which "
                f"{model_path!r} does not provide here ({error})"
            ) from error
        return explicit if explicit is not None else ALL_LINEAR
    if explicit is not None:
        return _checked_targets(explicit, kinds, model_path)
    wanted = [kind for kind, on in (("attn", train_attn), ("mlp", train_mlp)) if on]
    for kind, key in (("attn", "model.train_attn"), ("mlp", "model.train_mlp")):
        if kind in wanted and kind not in kinds.values():
            raise ValueError(
                f"{key}=true: no {'attention' if kind == 'attn' else 'MLP'} linear layers found in "
                f"{model_path!r}; name the modules with model.lora_target_modules=[...]"
            )
    return targets_for(kinds, wanted)


def _explicit_targets(cfg: Any, overrides: dict[str, Any]) -> str | tuple[str, ...] | None:
    """``model.lora_target_modules`` or SkyRL's own key; both set and different is an error."""
    skyrl_key = "skyrl.trainer.policy.model.lora.target_modules"
    ours = _as_targets("model.lora_target_modules", select(cfg, "model.lora_target_modules"))
    skyrl = _as_targets(skyrl_key, overrides.get(_POLICY + "target_modules"))
    if ours is not None and skyrl is not None and ours != skyrl:
        given = {"model.lora_target_modules": _shown(ours)}
        raise ValueError(disagreement(given, _shown(ours), skyrl_key, _shown(skyrl)))
    return ours if ours is not None else skyrl


def _shown(targets: str | tuple[str, ...]) -> str | list[str]:
    return targets if isinstance(targets, str) else list(targets)


def _as_targets(key: str, value: Any) -> str | tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise ValueError(
        f"{key}={value!r}: give a list of module names (e.g. [q_proj, v_proj]), a regular expression, "
        f"or {ALL_LINEAR!r}"
    )


def _checked_targets(
    targets: str | tuple[str, ...], kinds: dict[str, str], model_path: str
) -> str | tuple[str, ...]:
    """Every entry must wrap at least one linear layer, and none may be an embedding."""
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        return ALL_LINEAR
    names = list(kinds)
    entries = [targets] if isinstance(targets, str) else list(targets)
    for entry in entries:
        hits = matched_modules(entry if isinstance(targets, str) else [entry], names)
        if not hits:
            layers = sorted({n.rsplit(".", 1)[-1] for n, kind in kinds.items() if kind not in _EMBEDDINGS})
            raise ValueError(
                f"model.lora_target_modules: {entry!r} matches no layer of {model_path!r}; "
                f"its adaptable layers are named {layers}"
            )
        embeddings = [name for name in hits if kinds[name] in _EMBEDDINGS]
        if embeddings:
            raise ValueError(
                f"model.lora_target_modules: {entry!r} matches the embedding layer(s) {embeddings}; "
                "SkyRL hands the adapter to vLLM, which adapts embeddings for some architectures only "
                "and not tied ones: target attention and MLP layers"
            )
    return targets
