"""transformers' two import-time indexes, kept in a file per Python environment.

On import, transformers builds two tables that depend only on what is installed, in each of a
run's processes that import it (driver, training worker, CPU server), all during start-up and in
the training worker on the path to the first step:

- the map of every top-level import name to the distributions that install it
  (``importlib.metadata.packages_distributions``): Python builds it from every installed
  distribution's file list, checking that each listed file exists;
- the names each of its ~1,500 model modules exports (``define_import_structure``): it reads every
  one of those files, twice in a process that loads a model (for the package and for
  ``transformers.models``).

Both cost a noticeable share of a CPU run's start-up (bench/README.md: 'Start-up').

A distribution's install, upgrade or removal creates or removes its metadata directory, so each
table is kept in a file named after those directories and their modification times. A distribution
not kept in a directory on the path (none in a pip or uv environment) turns the files off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.metadata
import json
import os
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rllm_skyrl.compat import import_hooks
from rllm_skyrl.compat.patch import Patch
from rllm_skyrl.tiny_model import default_cache_dir

IMPORT_UTILS = "transformers.utils.import_utils"


def cache_dir(table: str = "packages_distributions") -> Path:
    return default_cache_dir().parent / table


def environment_key() -> str | None:
    """A name for the installed distributions as they are now; ``None`` if one is not a directory."""
    digest = hashlib.sha256(sys.version.encode())
    for distribution in importlib.metadata.distributions():
        path = getattr(distribution, "_path", None)
        if path is None:
            return None
        try:
            modified = os.stat(path).st_mtime_ns
        except OSError:
            return None
        digest.update(f"\0{path}\0{modified}".encode())
    return digest.hexdigest()[:32]


def load_or_build[T](
    file_name: str,
    table: str,
    build: Callable[[], T],
    encode: Callable[[T], Any] = lambda value: value,
    decode: Callable[[Any], T] = lambda value: value,
) -> T:
    """``table``'s value from ``<cache>/<table>/<environment key><file_name>.json``, else built and
    written there; a read-only home builds it each time, as without this set."""
    key = environment_key()
    if key is None:
        return build()
    file = cache_dir(table) / f"{key}{file_name}.json"
    try:
        return decode(json.loads(file.read_text()))
    except (OSError, ValueError):
        pass
    value = build()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False) as out:
            json.dump(encode(value), out)
        os.replace(out.name, file)
    except OSError:
        pass
    return value


def cached(build: Callable[[], dict[str, list[str]]]) -> Callable[[], dict[str, list[str]]]:
    @functools.wraps(build)
    def packages_distributions() -> dict[str, list[str]]:
        return load_or_build("", "packages_distributions", build)

    packages_distributions._rllm_skyrl_patched = True
    return packages_distributions


def _install_package_map() -> None:
    if not getattr(importlib.metadata.packages_distributions, "_rllm_skyrl_patched", False):
        importlib.metadata.packages_distributions = cached(importlib.metadata.packages_distributions)


Structure = dict[frozenset[str], dict[str, set[str]]]


def encode_structure(structure: Structure) -> list:
    """Frozensets and sets as sorted lists."""
    return [
        [sorted(backends), {module: sorted(names) for module, names in modules.items()}]
        for backends, modules in structure.items()
    ]


def decode_structure(rows: list) -> Structure:
    return {
        frozenset(backends): {module: set(names) for module, names in modules.items()}
        for backends, modules in rows
    }


def cached_structure(define: Callable[..., Structure], models_dir: Path) -> Callable[..., Structure]:
    """``define_import_structure`` reading its table for ``models_dir`` (given as the folder or as
    its ``__init__.py``) from the environment's file; every other folder as before."""

    @functools.lru_cache
    def define_import_structure(module_path, prefix=None) -> Structure:
        path = Path(module_path)
        folder = path.parent if path.name == "__init__.py" else path
        if folder != models_dir:
            return define(module_path, prefix)
        return load_or_build(
            f"-{path.name}-{prefix}",
            "transformers_import_structure",
            lambda: define(module_path, prefix),
            encode_structure,
            decode_structure,
        )

    define_import_structure._rllm_skyrl_patched = True
    return define_import_structure


def _cache_structure(import_utils: types.ModuleType) -> None:
    define = import_utils.define_import_structure
    if not getattr(define, "_rllm_skyrl_patched", False):
        models_dir = Path(import_utils.__file__).parent.parent / "models"
        import_utils.define_import_structure = cached_structure(define, models_dir)


def _run_then_cache(module: types.ModuleType, loader: importlib.abc.Loader) -> None:
    """transformers' module runs, and its table is made cached before anyone binds the function
    (``transformers/__init__.py`` imports the name right after the module runs)."""
    loader.exec_module(module)
    _cache_structure(module)


def _install_structure_table() -> None:
    if IMPORT_UTILS in sys.modules:  # later lookups (``transformers.models``) still use the file
        _cache_structure(sys.modules[IMPORT_UTILS])
    else:
        import_hooks.install(
            import_hooks.HookFinder("import_structure", lambda name: name == IMPORT_UTILS, _run_then_cache)
        )


PATCHES: tuple[Patch, ...] = (
    Patch(
        "cached_packages_distributions",
        (IMPORT_UTILS, "", "PACKAGE_DISTRIBUTION_MAPPING = importlib.metadata.packages_distributions()"),
        _install_package_map,
    ),
    Patch(
        "cached_import_structure",
        # the module's source: a patched process's ``define_import_structure`` is this module's
        (IMPORT_UTILS, "", "import_structure = create_import_structure_from_path(module_path)"),
        _install_structure_table,
    ),
)


def apply() -> None:
    """Install both cached tables (idempotent); a process that imported transformers already keeps
    its own package map and the table it built."""
    for patch in PATCHES:
        patch.install()
