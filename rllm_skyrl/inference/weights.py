"""Swapping weights into a live model: full HF checkpoints from the trainer, and LoRA adapters.

Both run on the generation thread between decode steps (see ``Scheduler.call``), so a forward
pass never sees half-copied weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rllm_skyrl.inference.errors import ApiError

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"


def read_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a ``save_pretrained`` directory (single file or sharded)."""
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise ApiError(
            400, f"weights path {str(root)!r} is not a directory; pass the save_pretrained output dir"
        )
    if (root / "model.safetensors").exists():
        return load_file(root / "model.safetensors")
    if (root / _SAFETENSORS_INDEX).exists():
        shards = sorted(set(json.loads((root / _SAFETENSORS_INDEX).read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(root / shard).items()}
    if (root / _BIN_INDEX).exists():
        bin_files = sorted(set(json.loads((root / _BIN_INDEX).read_text())["weight_map"].values()))
    elif (root / "pytorch_model.bin").exists():
        bin_files = ["pytorch_model.bin"]
    else:
        raise ApiError(
            400,
            f"no model.safetensors, {_SAFETENSORS_INDEX} or pytorch_model.bin in {str(root)!r}; "
            "write the weights with model.save_pretrained(dir)",
        )
    state: dict[str, torch.Tensor] = {}
    for name in bin_files:
        state.update(torch.load(root / name, map_location="cpu", weights_only=True))
    return state


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Keys that shared storage when the model was loaded (tied embeddings), remembered across untying."""
    groups = getattr(model, "_rllm_skyrl_tied_groups", None)
    if groups is None:
        by_storage: dict[int, list[str]] = {}
        for key, tensor in model.state_dict().items():
            by_storage.setdefault(tensor.data_ptr(), []).append(key)
        groups = [keys for keys in by_storage.values() if len(keys) > 1]
        model._rllm_skyrl_tied_groups = groups
    return groups


def load_full_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Copy a checkpoint into ``model``'s existing tensors (casting dtype), or refuse untouched.

    Keys and shapes are checked before anything is copied, so a wrong checkpoint leaves the
    served weights as they were. A tied key absent from the file takes its partner's value
    (tied embeddings are saved once).
    """
    groups = _tied_groups(model)
    incoming = read_hf_state_dict(path)
    for keys in groups:
        present = [key for key in keys if key in incoming]
        for key in keys if present else []:
            incoming.setdefault(key, incoming[present[0]])
    current = model.state_dict()
    missing = [key for key in current if key not in incoming]
    unexpected = [key for key in incoming if key not in current]
    mismatched = [
        f"{key}: file {tuple(t.shape)} vs model {tuple(current[key].shape)}"
        for key, t in incoming.items()
        if key in current and t.shape != current[key].shape
    ]
    if missing or unexpected or mismatched:
        raise ApiError(
            400,
            f"checkpoint at {str(path)!r} does not fit the served model "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]}, shape mismatch {mismatched[:5]}); "
            "it must come from the same architecture; to serve another one, restart the server with --model",
        )
    _untie_diverged(model, incoming, groups)
    current = model.state_dict()
    with torch.no_grad():
        for key, tensor in incoming.items():
            current[key].copy_(tensor)


def _untie_diverged(
    model: torch.nn.Module, incoming: dict[str, torch.Tensor], groups: list[list[str]]
) -> None:
    """Give tied tensors their own storage when the trainer sent them with different values.

    This package's trainer keeps them tied (``compat/tied_embeddings.py``), but a checkpoint from
    a trainer that trained ``lm_head`` and ``embed_tokens`` apart (SkyRL's FSDP set-up unpatched)
    would otherwise be served as a policy the trainer never had.
    """
    current = model.state_dict()
    for keys in groups:
        first = keys[0]
        for key in keys[1:]:
            shared = current[key].data_ptr() == current[first].data_ptr()
            if shared and not torch.equal(incoming[key], incoming[first]):
                module_name, _, param_name = key.rpartition(".")
                module = model.get_submodule(module_name)
                setattr(module, param_name, torch.nn.Parameter(getattr(module, param_name).detach().clone()))
                if getattr(model.config, "tie_word_embeddings", False):
                    model.config.tie_word_embeddings = False


class LoraAdapters:
    """PEFT LoRA adapters injected into the served model, addressed by name.

    One adapter (or the base model) is active per forward pass; the scheduler activates the
    adapter of the batch it is about to run. Reloading a name with the same LoRA shape copies
    the new tensors in place, as SkyRL does every training step.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._peft = None
        self._active: str | None = None
        self._stale = True

    @property
    def names(self) -> list[str]:
        return list(self._peft.peft_config) if self._peft is not None else []

    def load(self, name: str, path: str) -> None:
        from peft import PeftConfig, PeftModel
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        if not (Path(path) / "adapter_config.json").exists():
            raise ApiError(
                400,
                f"no adapter_config.json in {path!r}; write the adapter with PeftModel.save_pretrained(dir)",
            )
        config = PeftConfig.from_pretrained(path)
        self._stale = True
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
            return
        if name in self._peft.peft_config:
            if _lora_shape(self._peft.peft_config[name]) == _lora_shape(config):
                set_peft_model_state_dict(self._peft, load_peft_weights(path), adapter_name=name)
                return
            self.unload(name)
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
                return
        self._peft.load_adapter(path, adapter_name=name)

    def unload(self, name: str) -> None:
        if name not in self.names:
            raise ApiError(404, f"LoRA adapter {name!r} is not loaded; loaded adapters: {self.names}")
        self._stale = True
        if len(self.names) == 1:
            self._peft.unload()  # removes the LoRA layers, restoring the plain model's modules
            self._peft = None
        else:
            self._peft.delete_adapter(name)

    def activate(self, name: str | None) -> None:
        """Make ``name`` (None: the base model) the adapter the next forward passes use."""
        if not self._stale and name == self._active:
            return
        if self._peft is not None:
            if name is None:
                self._peft.base_model.disable_adapter_layers()
            else:
                self._peft.base_model.enable_adapter_layers()
                self._peft.base_model.set_adapter(name)
        self._active, self._stale = name, False


def _lora_shape(config) -> tuple:
    """The parts of a LoRA config that decide tensor shapes and scaling."""
    targets = config.target_modules
    targets = tuple(sorted(targets)) if isinstance(targets, list | set | tuple) else targets
    patterns = tuple(
        tuple(sorted((getattr(config, attr, None) or {}).items()))
        for attr in ("rank_pattern", "alpha_pattern")
    )
    return (
        config.peft_type,
        config.r,
        config.lora_alpha,
        targets,
        getattr(config, "use_rslora", False),
        patterns,
    )
