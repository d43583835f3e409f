"""Reading a composed config tree: dotted lookups as plain Python, and flattening to dotted keys."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


def select(cfg: DictConfig, key: str, default: Any = None) -> Any:
    """``cfg[key]`` by dotted path as plain Python (containers resolved); ``default`` when absent."""
    value = OmegaConf.select(cfg, key, default=default)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; empty dicts stay values (they may clear a field)."""
    if not isinstance(tree, dict) or not tree:
        return {prefix.rstrip("."): tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat
