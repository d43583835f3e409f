"""transformers' map of import names to distributions, kept in a file per Python environment.

On import, transformers builds the map of every top-level import name to the distributions that
install it (``importlib.metadata.packages_distributions``), to look package versions up later.
Python builds it from every installed distribution's file list, checking that each listed file
exists: about 0.55 CPU-seconds here, in each of a run's processes that import transformers (the
driver, the training worker, the CPU server), all of them during start-up, and in the training
worker on the chain that ends at the first step. The map changes only when a distribution is
installed, upgraded or removed, and each of those creates or removes its metadata directory: with
this set the map is read from a file named after those directories and their modification times,
and built by Python's own function (then written atomically) when there is none. A distribution
not kept in a directory on the path (none in a pip or uv environment) turns the file off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from rllm_skyrl.compat.patch import Patch
from rllm_skyrl.tiny_model import default_cache_dir


def cache_dir() -> Path:
    return default_cache_dir().parent / "packages_distributions"


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


def cached(build: Callable[[], dict[str, list[str]]]) -> Callable[[], dict[str, list[str]]]:
    @functools.wraps(build)
    def packages_distributions() -> dict[str, list[str]]:
        key = environment_key()
        if key is None:
            return build()
        file = cache_dir() / f"{key}.json"
        try:
            return json.loads(file.read_text())
        except (OSError, ValueError):
            pass
        mapping = build()
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False) as out:
                json.dump(mapping, out)
            os.replace(out.name, file)
        except OSError:  # a read-only home: the map is built each time, as without this set
            pass
        return mapping

    packages_distributions._rllm_skyrl_patched = True
    return packages_distributions


def _install() -> None:
    if not getattr(importlib.metadata.packages_distributions, "_rllm_skyrl_patched", False):
        importlib.metadata.packages_distributions = cached(importlib.metadata.packages_distributions)


PATCHES: tuple[Patch, ...] = (
    Patch(
        "cached_packages_distributions",
        (
            "transformers.utils.import_utils",
            "",
            "PACKAGE_DISTRIBUTION_MAPPING = importlib.metadata.packages_distributions()",
        ),
        _install,
    ),
)


def apply() -> None:
    """Install the cached map (idempotent); a process that imported transformers already keeps its own."""
    for patch in PATCHES:
        patch.install()
