"""An import stub for ``flash_attn.bert_padding``, installed wherever flash-attn is not.

SkyRL's model wrapper imports ``flash_attn.bert_padding`` at module level, whatever
``trainer.flash_attn`` says, so its FSDP workers cannot even be imported without flash-attn. PyPI
has no flash-attn wheels (only a source distribution that compiles against the installed torch),
so a CPU machine never has it and a CUDA machine only when the user added it. Without it SkyRL
runs sdpa attention (``trainer.flash_attn=false``) and unpadded micro-batches off
(``trainer.remove_microbatch_padding=false``, the only user of the stubbed helpers);
``Platform.skyrl_overrides`` sets both, this module only makes the import succeed.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

from rllm_skyrl.compat.patch import Patch
from rllm_skyrl.hardware import flash_attn_installed


def _unavailable(*_args, **_kwargs):
    raise RuntimeError(
        "flash-attn is not installed; set trainer.remove_microbatch_padding=false "
        "(rllm_skyrl does this automatically when flash-attn is missing)."
    )


def _install_stub() -> None:
    """``flash_attn.ops`` stays absent, so SkyRL's optional fused cross-entropy import keeps falling
    back to its torch implementation. A spec without an origin keeps ``importlib.util.find_spec``
    working while transformers' availability check (it reads the distribution metadata) still
    reports flash-attn absent, so nothing selects flash-attention kernels by accident.
    """
    if "flash_attn" in sys.modules or flash_attn_installed():
        return
    package = types.ModuleType("flash_attn")
    package.__path__ = []
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    bert_padding = types.ModuleType("flash_attn.bert_padding")
    bert_padding.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)
    bert_padding.pad_input = _unavailable
    bert_padding.unpad_input = _unavailable
    package.bert_padding = bert_padding
    sys.modules["flash_attn"] = package
    sys.modules["flash_attn.bert_padding"] = bert_padding


PATCHES: tuple[Patch, ...] = (
    Patch(
        "flash_attn_stub",
        ("skyrl.backends.skyrl_train.workers.model_wrapper", "", "from flash_attn.bert_padding import"),
        _install_stub,
    ),
)


def apply() -> None:
    """Install the stub unless the real flash-attn is importable; idempotent."""
    for patch in PATCHES:
        patch.install()


def is_stubbed() -> bool:
    module = sys.modules.get("flash_attn")
    return module is not None and getattr(module, "__file__", None) is None
