"""The ``rllm_agent_trainer`` set: rLLM's ``AgentTrainer(backend="skyrl")`` builds this package's launcher.

rLLM's ``AgentTrainer`` picks its launcher with an if/elif over backend names and has no table to
add one to, so its constructor is wrapped in place (code that imported the class already sees the
change). The wrapper changes one case only: ``backend="skyrl"``, or a config composed for
``rllm/backend=skyrl`` (``rllm.backend: skyrl``, which wins over a name fixed in code). Every other
call reaches rLLM's constructor with the same arguments, untouched.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

logger = logging.getLogger(__name__)

BACKEND_NAME = "skyrl"
TRAINER_MODULE = "rllm.trainer.unified_trainer"
_ORIGINAL_INIT = "__rllm_skyrl_original_init__"


def selected_backend(argument: str | None, config: Any) -> str | None:
    """The backend to build: the config group the user picked wins over a name fixed in code.

    Several of rLLM's example scripts pass ``AgentTrainer(backend="tinker")`` while their shell
    scripts choose the config group; with ``rllm/backend=skyrl`` the composed config only has this
    backend's keys, so building tinker's launcher from it could only fail.
    """
    chosen = OmegaConf.select(config, "rllm.backend") if isinstance(config, DictConfig) else None
    if chosen == BACKEND_NAME and argument != BACKEND_NAME:
        logger.warning(
            "AgentTrainer(backend=%r) with the config composed for rllm/backend=%s: training with %s",
            argument,
            BACKEND_NAME,
            BACKEND_NAME,
        )
        return BACKEND_NAME
    return argument


def apply(launcher_cls: type) -> None:
    """rLLM's ``AgentTrainer`` builds ``launcher_cls`` (``rllm_plugin.SkyRLTrainerLauncher``) for skyrl."""
    install(importlib.import_module(TRAINER_MODULE).AgentTrainer, launcher_cls)


def install(agent_trainer: type, launcher_cls: type) -> None:
    """Wrap ``agent_trainer.__init__`` to build ``launcher_cls`` for this backend; safe to call twice."""
    original = agent_trainer.__init__
    if hasattr(original, _ORIGINAL_INIT):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if selected_backend(arguments.pop("backend", None), arguments.get("config")) != BACKEND_NAME:
            original(self, *args, **kwargs)
            return
        arguments.pop("self")
        for parameter in signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(parameter.name, {}))
        arguments["backend_name"] = BACKEND_NAME
        self.launcher = launcher_cls(**arguments)

    setattr(__init__, _ORIGINAL_INIT, original)
    agent_trainer.__init__ = __init__


def remove() -> None:
    """rLLM's own ``AgentTrainer`` constructor again (if rLLM's trainer was imported at all)."""
    module = sys.modules.get(TRAINER_MODULE)
    if module is None:
        return
    original = getattr(module.AgentTrainer.__init__, _ORIGINAL_INIT, None)
    if original is not None:
        module.AgentTrainer.__init__ = original
