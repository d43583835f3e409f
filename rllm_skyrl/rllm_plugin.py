"""Training under rLLM's own trainer, when rLLM is installed.

Three ways in, from the most explicit to the most convenient:

1. ``rllm.trainer.unified_trainer.UnifiedTrainer(backend_cls=SkyRLBackend, config=cfg, ...)``:
   ``SkyRLBackend`` implements rLLM's backend hooks; nothing from this module is needed.
2. ``SkyRLTrainerLauncher(cfg, workflow_class=..., ...).train()``: what rLLM's per-backend launchers
   do (build the trainer, fit, always shut down), through the run every entry point gets
   (``training_run.train``).
3. ``register()``, then rLLM's ``AgentTrainer(config=cfg, workflow_class=..., backend="skyrl").train()``.
   rLLM's ``AgentTrainer`` picks its launcher with an if/elif over backend names and has no table
   to add to, so ``register()`` wraps its constructor: ``backend="skyrl"`` builds a
   ``SkyRLTrainerLauncher``; every other value runs rLLM's own constructor untouched.

The config side needs no call: with this package installed, the Hydra plug-in in
``hydra_plugins/rllm_skyrl_searchpath`` makes ``rllm/backend=skyrl`` resolve inside rLLM's
``unified`` config.

Importing this module never imports rLLM (so it is safe in environments without it); ``register()``
and ``SkyRLTrainerLauncher.train()`` do, and raise ``MissingDependencyError`` with the install
command when it is absent.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm_skyrl.optional_deps import require

logger = logging.getLogger(__name__)

BACKEND_NAME = "skyrl"
_TRAINER_MODULE = "rllm.trainer.unified_trainer"
_ORIGINAL_INIT = "__rllm_skyrl_original_init__"

# rLLM routes these paths' inference through its model gateway, which only knows Tinker's and
# verl's engines by class name; with any other engine it registers no worker and rollouts hang.
_GATEWAY_ARGUMENTS = ("agent_flow", "evaluator", "hooks", "sandbox_backend", "sandbox_concurrency")


class SkyRLTrainerLauncher:
    """One training run under rLLM's ``UnifiedTrainer`` with ``SkyRLBackend``.

    Takes the constructor arguments rLLM's ``AgentTrainer`` gives its launchers, so the dispatch
    in ``register()`` builds it the same way rLLM builds its own. It does not subclass rLLM's
    ``TrainerLauncher`` because that would import rLLM when this module is imported.

    ``backend_cls`` lets a subclass of ``SkyRLBackend`` (custom hooks) go through the same path;
    ``backend_args`` are added to the backend's constructor arguments; remaining keyword arguments
    reach ``UnifiedTrainer`` unchanged.
    """

    def __init__(
        self,
        config: DictConfig,
        workflow_class: type | None = None,
        train_dataset: Any = None,
        val_dataset: Any = None,
        workflow_args: dict | None = None,
        store: Any = None,
        backend_cls: type | None = None,
        backend_args: dict | None = None,
        **kwargs: Any,
    ) -> None:
        gateway = [name for name in _GATEWAY_ARGUMENTS if kwargs.get(name) is not None]
        if OmegaConf.select(config, "rllm.remote_runtime.enabled", default=False):
            gateway.append("rllm.remote_runtime.enabled")
        if gateway:
            raise NotImplementedError(
                f"backend={BACKEND_NAME!r} trains workflow_class workflows; {', '.join(gateway)} route "
                "inference through rLLM's model gateway, which does not serve SkyRL's engine yet"
            )
        if workflow_class is None:
            raise ValueError(f"backend={BACKEND_NAME!r} needs workflow_class (an rLLM Workflow subclass)")
        self.config = config
        self.workflow_class = workflow_class
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.workflow_args = workflow_args or {}
        self.store = store
        self.backend_cls = backend_cls
        self.backend_args = backend_args or {}
        self.kwargs = {name: value for name, value in kwargs.items() if name not in _GATEWAY_ARGUMENTS}

    def train(self) -> None:
        """Train under rLLM's ``UnifiedTrainer`` through ``training_run.train``: the run every entry
        gets (secrets masked, ``metrics.jsonl``, progress bar, ``metrics.png``, summary, clean stop),
        with Ray, workers and servers shut down however it ends."""
        unified = require("rllm", _TRAINER_MODULE)
        from rllm_skyrl.training_run import train

        train(
            self.config,
            self.workflow_class,
            self.workflow_args,
            self.train_dataset,
            self.val_dataset,
            trainer_cls=unified.UnifiedTrainer,
            backend_cls=self.backend_cls,
            backend_args=self.backend_args,
            store=self.store,
            **self.kwargs,
        )


def _selected_backend(argument: str | None, config: Any) -> str | None:
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


def register() -> None:
    """Make rLLM's ``AgentTrainer(backend="skyrl")`` run ``SkyRLTrainerLauncher``; safe to call twice.

    Wraps ``AgentTrainer.__init__`` in place rather than replacing the class, so code that already
    imported ``AgentTrainer`` (``from rllm.trainer import AgentTrainer``) sees the change too.
    """
    agent_trainer = require("rllm", _TRAINER_MODULE).AgentTrainer
    original = agent_trainer.__init__
    if hasattr(original, _ORIGINAL_INIT):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if _selected_backend(arguments.pop("backend", None), arguments.get("config")) != BACKEND_NAME:
            original(self, *args, **kwargs)
            return
        arguments.pop("self")
        for parameter in signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(parameter.name, {}))
        arguments["backend_name"] = BACKEND_NAME
        self.launcher = SkyRLTrainerLauncher(**arguments)

    setattr(__init__, _ORIGINAL_INIT, original)
    agent_trainer.__init__ = __init__


def unregister() -> None:
    """Undo ``register()``: rLLM's own ``AgentTrainer`` constructor again."""
    module = sys.modules.get(_TRAINER_MODULE)
    if module is None:
        return
    original = getattr(module.AgentTrainer.__init__, _ORIGINAL_INIT, None)
    if original is not None:
        module.AgentTrainer.__init__ = original
