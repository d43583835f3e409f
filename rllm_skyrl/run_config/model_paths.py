"""Model names -> directories this machine can load: built-in names, HF model directories, hub ids."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# Model names that need no hub: built in-process, or converted from a PyPI wheel.
BUILTIN_MODELS = ("tiny", "smollm2")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model_path(path: str) -> str:
    if path == "tiny":
        from rllm_skyrl.tiny_model import build_tiny_model

        return str(build_tiny_model())
    if path == "smollm2":
        from rllm_skyrl.smollm2 import smollm2_path

        return str(smollm2_path())
    return path


def check_model_path(key: str, path: Any) -> None:
    """Raise ``ValueError`` naming ``key`` unless ``path`` is a model this machine can load."""
    if path is None or path in BUILTIN_MODELS:
        return
    if not isinstance(path, str) or not path.strip():
        raise ValueError(
            f"{key}={path!r}: expected an HF model directory, a hub id (org/name), or tiny/smollm2"
        )
    directory = Path(path).expanduser()
    if directory.is_dir():
        if not (directory / "config.json").exists():
            raise ValueError(f"{key}={path!r}: the directory has no config.json; give an HF model directory")
        return
    if directory.exists() or not _HUB_ID.fullmatch(path):
        raise ValueError(
            f"{key}={path!r}: no such model directory; give an HF model directory, a hub id (org/name) "
            "on a machine that may download, or tiny/smollm2"
        )
