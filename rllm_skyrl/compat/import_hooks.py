"""Running chosen modules through our own step instead of their loader's ``exec_module``.

For the sets that must act when a third-party module is imported, wherever the import comes from:
``lazy_imports`` and ``transformers_import_cache``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable

ExecModule = Callable[[types.ModuleType, importlib.abc.Loader], None]


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader for creating it; ``exec_module`` for running it."""

    def __init__(self, loader: importlib.abc.Loader, exec_module: ExecModule) -> None:
        self.loader = loader
        self.hook = exec_module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__.loader = module.__loader__ = self.loader  # as if imported without us
        self.hook(module, self.loader)


class HookFinder(importlib.abc.MetaPathFinder):
    """Finds the modules ``wanted`` accepts where Python would, and hands them out to be run by
    ``exec_module(module, its own loader)``; every other module is left to the finders after it."""

    def __init__(self, name: str, wanted: Callable[[str], bool], exec_module: ExecModule) -> None:
        self.name = name
        self.wanted = wanted
        self.exec_module = exec_module

    def find_spec(self, name, path, target=None):
        if not self.wanted(name):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _HookedLoader(spec.loader, self.exec_module)
        return spec


def install(finder: HookFinder) -> None:
    """First on ``sys.meta_path``, once per ``finder.name``."""
    if not any(isinstance(other, HookFinder) and other.name == finder.name for other in sys.meta_path):
        sys.meta_path.insert(0, finder)
