"""A warning for an environment whose libraries a run would compile from source in every process."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import sysconfig

logger = logging.getLogger(__name__)


def missing_bytecode(package: str) -> bool:
    """Whether the installed ``package`` is source with no byte-code beside it (found, not imported)."""
    spec = importlib.util.find_spec(package)
    source = (spec and spec.origin) or ""
    return source.endswith(".py") and not os.path.exists(importlib.util.cache_from_source(source))


def warn_if_compiled_at_every_start(package: str = "torch") -> None:
    """Where ``PYTHONDONTWRITEBYTECODE`` is set (many container images set it), Python never writes
    byte-code, so an environment installed without it (uv's default) has each of a run's processes
    compile torch, transformers and the rest from source: start-up takes 2-3x as long
    (bench/README.md: 'Start-up'). One warning, naming the fix; ``package`` stands for the rest."""
    if not sys.dont_write_bytecode or not missing_bytecode(package):
        return
    logger.warning(
        "the installed libraries have no byte-code and PYTHONDONTWRITEBYTECODE is set, so every process "
        "of this run compiles torch, transformers and the rest from source (start-up takes 2-3x as long); "
        "compile them once: %s -m compileall -q -j 0 %s (or install with uv pip install --compile-bytecode)",
        sys.executable,
        sysconfig.get_paths()["purelib"],
    )
