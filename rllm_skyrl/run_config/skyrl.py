"""SkyRL's typed config (``SkyRLTrainConfig``) from dotted overrides, with errors that name the whole key.

SkyRL's own ``from_cli_overrides`` names only the leaf of an unknown key; a user who typed
``skyrl.trainer.polcy.model.path`` needs to see which level is wrong and what it holds.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from rllm_skyrl.hardware import Platform


def make_skyrl_config(overrides: dict[str, Any] | None = None, platform: Platform | None = None):
    """A ``SkyRLTrainConfig`` from ``{dotted_key: value}``. The platform's (default: this machine's)
    settings win: SkyRL cannot run otherwise, and a silently wrong value would fail much later."""
    from skyrl.train.config.config import SkyRLTrainConfig

    merged = {**(overrides or {}), **(platform or Platform.detect()).skyrl_overrides()}
    for key in merged:
        check_key(SkyRLTrainConfig, key)
    return SkyRLTrainConfig.from_cli_overrides(merged)


def check_key(config_cls: type, key: str) -> None:
    """Raise naming the whole dotted key when it is not a field of SkyRL's config tree."""
    node: Any = config_cls
    for depth, part in enumerate(key.split(".")):
        if not dataclasses.is_dataclass(node):
            return  # a dict-valued field (e.g. model_config_kwargs): free-form below this point
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            where = ".".join(key.split(".")[:depth]) or "the top level"
            raise ValueError(
                f"unknown SkyRL config key {key!r}: {where} has no field {part!r}; "
                f"its fields are {sorted(fields)}"
            )
        hint = typing.get_type_hints(node).get(part)
        candidates = [hint, *typing.get_args(hint)]
        node = next((c for c in candidates if dataclasses.is_dataclass(c)), None)
