"""Optional dependencies: one clear ``ImportError`` that says what to install.

vLLM only installs on GPU machines, Modal only matters for cloud runs, and rLLM is not on PyPI, so
none of them is a hard dependency. ``require(name)`` instead of a bare import gives a user without
one an error naming the install command, not a traceback from deep inside SkyRL or rLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class OptionalDependency:
    """A package we import only on some code paths, and how a user gets it."""

    module: str
    purpose: str
    install: str


OPTIONAL: dict[str, OptionalDependency] = {
    dep.module: dep
    for dep in (
        OptionalDependency("vllm", "vLLM inference servers on GPU", "pip install 'rllm-skyrl[gpu]'"),
        OptionalDependency(
            "modal", "launching runs on Modal (modal_run.py)", "pip install 'rllm-skyrl[modal]'"
        ),
        OptionalDependency(
            "gguf",
            "loading SmolLM2 from its GGUF file (rllm_skyrl.smollm2)",
            "pip install 'rllm-skyrl[smollm2]'",
        ),
        OptionalDependency(
            "rllm",
            "training under rLLM's own trainer (rllm_skyrl.rllm_plugin)",
            "git clone https://github.com/rllm-org/rllm.git, then run scripts/install_rllm.sh <that "
            "checkout> from rllm-skyrl's (rLLM is not on PyPI, and pip alone would move rich and "
            "transformers below what SkyRL needs)",
        ),
    )
}


class MissingDependencyError(ImportError):
    """An optional dependency is absent or broken; the message carries the command that fixes it."""

    def __init__(self, dependency: OptionalDependency, failure: ImportError | None = None) -> None:
        state = "not installed"
        if failure is not None:
            state = f"installed but failed to import ({type(failure).__name__}: {failure}); reinstall it"
        super().__init__(
            f"{dependency.purpose} needs {dependency.module!r}, which is {state}: {dependency.install}",
            name=dependency.module,
        )


def is_installed(name: str) -> bool:
    """Whether the dependency can be found, without importing it."""
    return importlib.util.find_spec(OPTIONAL[name].module) is not None


def require(name: str, module: str | None = None) -> ModuleType:
    """Import ``module`` (default: the dependency's top-level package) or raise ``MissingDependencyError``.

    ``module`` may be a submodule (``rllm.trainer.unified_trainer``): a dependency of the dependency
    that is missing is then reported as a broken install of ``name``.
    """
    dependency = OPTIONAL[name]
    if not is_installed(name):
        raise MissingDependencyError(dependency)
    try:
        return importlib.import_module(module or dependency.module)
    except ImportError as error:
        raise MissingDependencyError(dependency, error) from error
