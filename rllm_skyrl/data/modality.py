"""Image rows need a model that sees images: refused in one line before anything starts.

A vision task (rLLM's geo3k: an ``images`` field on every row) sent to a text-only model would
not fail loudly: the flow's calls would be rejected one by one and every episode would score zero.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rllm_skyrl.run_config.model_paths import BUILTIN_MODELS

IMAGE_FIELDS = ("images", "image")
ROWS_LOOKED_AT = 8  # image datasets carry images on every row; a few tell


def image_field(rows: Any) -> str | None:
    """The image field the first rows of ``rows`` (a list or rLLM ``Dataset``) fill, or None."""
    if rows is None:
        return None
    for index in range(min(len(rows), ROWS_LOOKED_AT)):
        row = rows[index]
        if isinstance(row, dict):
            for field in IMAGE_FIELDS:
                if row.get(field) is not None and len(row[field]) > 0:
                    return field
    return None


def is_text_only(model: str) -> bool:
    """Whether ``model`` surely sees no images: a built-in test model, or a local HF directory whose
    config has no ``vision_config``. A hub id is not looked up (that would download it)."""
    if model in BUILTIN_MODELS:
        return True
    config = Path(model).expanduser() / "config.json"
    return config.is_file() and "vision_config" not in json.loads(config.read_text())


def text_only_refusal(model: str, **datasets: Any) -> str | None:
    """Why these datasets cannot train ``model``, or None: a dataset whose rows carry images, given
    a text-only model."""
    if not model:
        return None
    for name, rows in datasets.items():
        field = image_field(rows)
        if field is not None and is_text_only(model):
            return (
                f"{name} rows carry images ({field!r}) but model {model} is text-only (its config has no "
                "vision_config); use a vision-language model, or a dataset without images"
            )
    return None
