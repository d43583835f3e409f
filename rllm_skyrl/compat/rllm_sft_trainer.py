"""A backend table for rLLM's ``AgentSFTTrainer``: ``BACKENDS`` maps a name to an ``SFTBackend`` class.

rLLM's SFT dispatcher picks its backend with an if-chain in ``AgentSFTTrainer._make_backend`` and
answers "Unknown SFT backend" for any other name; there is no table to add one to. ``apply`` wraps
that method in place (code that imported the class already sees the change) so that a name in
``BACKENDS`` builds its class from the spec, and lists the table's names among those its error
names; every other name runs rLLM's method untouched. ``rllm_plugin.register`` applies it with
``SkyRLSFTBackend``.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

DISPATCHER_MODULE = "rllm.trainer.agent_sft_trainer"
BACKENDS: dict[str, type] = {}
_ORIGINAL = "__rllm_skyrl_original_make_backend__"


def apply(backend_cls: type) -> None:
    """Route ``backend_cls.name`` (and the names already in ``BACKENDS``) to their classes; safe to
    call twice."""
    BACKENDS[backend_cls.name] = backend_cls
    module = importlib.import_module(DISPATCHER_MODULE)
    trainer = module.AgentSFTTrainer
    original = trainer._make_backend
    if hasattr(original, _ORIGINAL):
        return

    @functools.wraps(original)
    def _make_backend(self: Any) -> Any:
        backend_cls = BACKENDS.get(self.backend_name)
        if backend_cls is None:
            module._IMPLEMENTED.update(BACKENDS)  # so rLLM's error lists them
            return original(self)
        return backend_cls(self.spec)

    setattr(_make_backend, _ORIGINAL, original)
    trainer._make_backend = _make_backend


def remove() -> None:
    """rLLM's own ``_make_backend`` again (if rLLM's dispatcher was imported at all)."""
    module = sys.modules.get(DISPATCHER_MODULE)
    if module is None:
        return
    original = getattr(module.AgentSFTTrainer._make_backend, _ORIGINAL, None)
    if original is not None:
        module.AgentSFTTrainer._make_backend = original
        module._IMPLEMENTED.difference_update(BACKENDS)
