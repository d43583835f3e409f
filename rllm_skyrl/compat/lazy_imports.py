"""Packages SkyRL's modules import at their top and a run mostly never uses: run on first use instead.

A training worker's imports are most of the longest chain of a run's start-up (Ray, the worker's
imports, its model). Three serve nothing a worker does and the driver only sometimes: wandb
(``skyrl.utils.log``, for the driver's tracker when it logs to wandb), HF ``datasets``
(``transformers.trainer``, imported by SkyRL's FSDP strategy for one scheduler function; it brings
pyarrow and more for ``isinstance`` checks in a ``Trainer`` nobody builds) and pandas
(``skyrl_gym``'s SQL tool, reached through SkyRL's config module). Their code runs at the first
lookup of a name they define (``DeferredModule``), so a process that uses one gets it complete.
Applied before any SkyRL module is imported.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import types

from rllm_skyrl.compat import import_hooks
from rllm_skyrl.compat.patch import Patch

LAZY = ("wandb", "datasets", "pandas")


class DeferredModule(types.ModuleType):
    """A module whose code has not run: the first name looked up that it does not hold runs it.

    The names the import system sets (``__name__``, ``__file__``, ``__spec__``, ...) are there
    from the start, so code that scans ``sys.modules`` (``inspect.getmodule``, which torch calls
    whenever it registers an operator) finds them without running the module; ``__path__`` is
    held back, so importing a submodule runs its package first, as it would without this.
    """

    def __getattr__(self, name: str):
        _run(self)
        return getattr(self, name)


def _run(module: types.ModuleType) -> None:
    spec = module.__spec__
    with spec.loader_state["lock"]:
        if type(module) is not DeferredModule:  # another thread ran it meanwhile
            return
        module.__class__ = types.ModuleType  # its code sees a plain module, as in an eager import
        if spec.loader_state["path"] is not None:
            module.__path__ = spec.loader_state["path"]
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(spec.name, None)  # as a failed import leaves it
            raise


def _defer(module: types.ModuleType, loader: importlib.abc.Loader) -> None:
    path = module.__dict__.pop("__path__", None)
    module.__spec__.loader_state = {"lock": threading.RLock(), "path": path}
    module.__class__ = DeferredModule


def _load_lazily() -> None:
    import_hooks.install(import_hooks.HookFinder("lazy_imports", lambda name: name in LAZY, _defer))


PATCHES: tuple[Patch, ...] = (
    Patch("lazy_wandb", ("skyrl.utils.log", "", "import wandb"), _load_lazily),
    Patch("lazy_datasets", ("transformers.trainer", "", "import datasets"), _load_lazily),
    Patch("lazy_pandas", ("skyrl_gym.tools.sql", "", "import pandas as pd"), _load_lazily),
)


def apply() -> None:
    """Install the finder (idempotent). Packages imported before stay as they are."""
    for patch in PATCHES:
        patch.install()
