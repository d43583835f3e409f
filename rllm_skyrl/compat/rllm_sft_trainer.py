"""rLLM's ``AgentSFTTrainer(spec, backend="skyrl")`` builds ``rllm_skyrl.sft.backend.SkyRLSFTBackend``.

rLLM's SFT dispatcher picks its backend with an if-chain in ``AgentSFTTrainer._make_backend`` and
answers "Unknown SFT backend" for any other name; there is no table to add one to. ``apply`` wraps
that method in place (code that imported the class already sees the change) and adds ``skyrl`` to
the names its error lists; every other backend name runs rLLM's method untouched.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

BACKEND_NAME = "skyrl"
DISPATCHER_MODULE = "rllm.trainer.agent_sft_trainer"
_ORIGINAL = "__rllm_skyrl_original_make_backend__"


def apply() -> None:
    """Teach rLLM's ``AgentSFTTrainer`` the ``skyrl`` backend; safe to call twice."""
    import importlib

    module = importlib.import_module(DISPATCHER_MODULE)
    trainer = module.AgentSFTTrainer
    original = trainer._make_backend
    if hasattr(original, _ORIGINAL):
        return

    @functools.wraps(original)
    def _make_backend(self: Any) -> Any:
        if self.backend_name != BACKEND_NAME:
            return original(self)
        from rllm_skyrl.sft.backend import SkyRLSFTBackend

        return SkyRLSFTBackend(self.spec)

    setattr(_make_backend, _ORIGINAL, original)
    trainer._make_backend = _make_backend
    module._IMPLEMENTED.add(BACKEND_NAME)


def remove() -> None:
    """rLLM's own ``_make_backend`` again (if rLLM's dispatcher was imported at all)."""
    module = sys.modules.get(DISPATCHER_MODULE)
    if module is None:
        return
    original = getattr(module.AgentSFTTrainer._make_backend, _ORIGINAL, None)
    if original is not None:
        module.AgentSFTTrainer._make_backend = original
        module._IMPLEMENTED.discard(BACKEND_NAME)
