"""Swapping weights into a live model: full HF checkpoints from the trainer, and LoRA adapters.

Both run on the generation thread between decode steps (``Scheduler.call``), so a forward pass
never sees half-copied weights, and both read only under the server's ``WeightsRoot``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

import torch

from rllm_skyrl.inference.checks import shown
from rllm_skyrl.inference.errors import ApiError

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


class WeightsRoot:
    """The tree a server may load weights and adapters from (None: nothing). A requested path, and
    every file opened from it (shards an index names included), must resolve, symlinks followed,
    under the root; otherwise the answer is the same "path outside" whether or not the path exists,
    so the server cannot be used to probe the filesystem."""

    def __init__(self, root: str | Path | None):
        self.root = Path(os.path.realpath(root)) if root is not None else None

    def directory(self, path: object, what: str) -> Path:
        if self.root is None:
            raise ApiError(
                400,
                f"this server loads no {what}: it was started without --weights-root; restart it with "
                f"--weights-root DIR and write the {what} under DIR",
            )
        if not isinstance(path, str) or not path or "\x00" in path:
            raise ApiError(400, f"the {what} path must be a non-empty string, got {shown(path)}")
        return self._inside(path)

    def file(self, directory: Path, name: object) -> Path:
        """A file of ``directory`` by a name read from disk (an index's shard names)."""
        parts = PurePosixPath(name).parts if isinstance(name, str) and name and "\x00" not in name else ()
        if not parts or parts[0] == "/" or ".." in parts or "\\" in name:
            raise ApiError(400, f"file name {shown(name)} in {directory} leaves that directory")
        return self._inside(str(directory / name))

    def _inside(self, path: str) -> Path:
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(self.root):
            raise ApiError(
                400,
                f"path outside {self.root}: the server reads weights only from under that directory "
                f"(got {shown(path)})",
            )
        return real


def read_hf_state_dict(directory: Path, root: WeightsRoot) -> dict[str, torch.Tensor]:
    """Read every tensor of a ``save_pretrained`` directory (single file or sharded) under ``root``."""
    if not directory.is_dir():
        raise ApiError(
            400, f"weights path {str(directory)!r} is not a directory; pass the save_pretrained output dir"
        )
    try:
        return _read_state(directory, root)
    except ApiError:
        raise
    except Exception as exc:  # a torn or foreign file: the caller's checkpoint, not the server, is at fault
        raise ApiError(
            400, f"could not read the weights in {str(directory)!r} ({type(exc).__name__}: {exc})"
        ) from exc


def _read_state(directory: Path, root: WeightsRoot) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (directory / "model.safetensors").exists():
        return load_file(root.file(directory, "model.safetensors"))
    if (directory / _SAFETENSORS_INDEX).exists():
        shards = _index_files(directory, _SAFETENSORS_INDEX, root)
        return {k: v for shard in shards for k, v in load_file(shard).items()}
    if (directory / _BIN_INDEX).exists():
        bin_files = _index_files(directory, _BIN_INDEX, root)
    elif (directory / "pytorch_model.bin").exists():
        bin_files = [root.file(directory, "pytorch_model.bin")]
    else:
        raise ApiError(
            400,
            f"no model.safetensors, {_SAFETENSORS_INDEX} or pytorch_model.bin in {str(directory)!r}; "
            "write the weights with model.save_pretrained(dir)",
        )
    return {
        k: v for path in bin_files for k, v in torch.load(path, map_location="cpu", weights_only=True).items()
    }


def _index_files(directory: Path, index_name: str, root: WeightsRoot) -> list[Path]:
    """The shard files an HF index names, each checked before anything is opened."""
    index = json.loads(root.file(directory, index_name).read_text())
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ApiError(400, f"{index_name} in {str(directory)!r} has no 'weight_map' object")
    return [root.file(directory, name) for name in sorted(set(weight_map.values()), key=str)]


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


def load_full_weights(model: torch.nn.Module, directory: Path, root: WeightsRoot) -> None:
    """Copy a checkpoint into ``model``'s existing tensors (casting dtype). Keys and shapes are all
    checked first, so a wrong checkpoint leaves the served weights as they were. A tied key absent
    from the file takes its partner's value (tied embeddings are saved once)."""
    groups = _tied_groups(model)
    incoming = read_hf_state_dict(directory, root)
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
            f"checkpoint at {str(directory)!r} does not fit the served model "
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
    """Give tied tensors their own storage when the checkpoint holds different values for them: this
    package's trainer keeps them tied (``compat/tied_embeddings.py``), but a checkpoint that trained
    ``lm_head`` and ``embed_tokens`` apart (SkyRL's FSDP set-up unpatched) would otherwise be served
    as a policy the trainer never had."""
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
    """PEFT LoRA adapters injected into the served model, addressed by name; one (or the base model)
    is active per forward pass. Reloading a name with the same LoRA shape copies the new tensors in
    place, as SkyRL does every training step."""

    def __init__(self, model: torch.nn.Module, root: WeightsRoot):
        self.model = model
        self.root = root
        self._peft = None
        self._active: str | None = None
        self._stale = True

    @property
    def names(self) -> list[str]:
        return list(self._peft.peft_config) if self._peft is not None else []

    def load(self, name: str, path: str) -> None:
        """Load (or refresh in place) adapter ``name`` from a ``PeftModel.save_pretrained`` dir."""
        directory = self.root.directory(path, "LoRA adapters")
        files = [n for n in _ADAPTER_FILES if (directory / n).exists()]
        if "adapter_config.json" not in files or len(files) < 2:
            raise ApiError(
                400,
                f"{path!r} needs adapter_config.json and adapter_model.safetensors (or .bin); write the "
                "adapter with PeftModel.save_pretrained(dir)",
            )
        for file in files:
            self.root.file(directory, file)
        try:
            self._load(name, str(directory))
        except Exception as exc:  # an adapter that does not fit this model is the caller's to fix
            raise ApiError(
                400, f"could not load the LoRA adapter in {path!r} ({type(exc).__name__}: {exc})"
            ) from exc

    def _load(self, name: str, path: str) -> None:
        from peft import PeftConfig, PeftModel
        from peft.utils import load_peft_weights, set_peft_model_state_dict

        config = PeftConfig.from_pretrained(path)
        self._stale = True
        if self._peft is not None and name in self._peft.peft_config:
            if _lora_shape(self._peft.peft_config[name]) == _lora_shape(config):
                set_peft_model_state_dict(self._peft, load_peft_weights(path), adapter_name=name)
                return
            self.unload(name)
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self.model, path, adapter_name=name)
        else:
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
    rslora = getattr(config, "use_rslora", False)
    return config.peft_type, config.r, config.lora_alpha, targets, rslora, patterns
