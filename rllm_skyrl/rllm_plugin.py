"""Training under rLLM's own trainer, when rLLM is installed.

Three ways in, each training a ``workflow_class`` or an ``agent_flow`` with an ``evaluator`` (or
``hooks``), the flow's calls going through rLLM's model gateway (``compat/rllm_gateway.py``):
``UnifiedTrainer(backend_cls=SkyRLBackend, ...)`` directly (nothing from here);
``SkyRLTrainerLauncher(cfg, workflow_class=...).train()``, what rLLM's per-backend launchers do,
through the run every entry point gets (``training_run.train``); or ``register()``, then rLLM's
``AgentTrainer(..., backend="skyrl")`` (the ``rllm_agent_trainer`` patch set: rLLM has no table of
backends to add one to). ``register()`` also gives rLLM's SFT dispatcher the backend:
``AgentSFTTrainer(spec, backend="skyrl")`` (the ``rllm_sft_trainer`` patch set). The config side
needs no call: the Hydra plug-in in
``hydra_plugins/rllm_skyrl_searchpath`` makes ``rllm/backend=skyrl`` resolve in rLLM's ``unified``.

Importing this module never imports rLLM; ``register()`` and ``SkyRLTrainerLauncher.train()`` do,
and raise ``MissingDependencyError`` with the install command when it is absent.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from rllm_skyrl import compat
from rllm_skyrl.compat import rllm_sft_trainer
from rllm_skyrl.compat.rllm_agent_trainer import BACKEND_NAME, TRAINER_MODULE, remove
from rllm_skyrl.data import modality
from rllm_skyrl.optional_deps import require
from rllm_skyrl.rollout import gateway

# rLLM's AgentTrainer consumes these (it wires sandbox hooks from them); this launcher stands in
# for it and provisions no sandboxes, so they are refused rather than dropped.
_SANDBOX_ARGUMENTS = ("sandbox_backend", "sandbox_concurrency")


class SkyRLTrainerLauncher:
    """One training run under rLLM's ``UnifiedTrainer`` with ``SkyRLBackend``.

    Takes the arguments rLLM's ``AgentTrainer`` gives its launchers, but does not subclass rLLM's
    ``TrainerLauncher``: that would import rLLM with this module. ``backend_cls``: a ``SkyRLBackend``
    subclass (custom hooks); ``backend_args`` go to the backend, other keywords to ``UnifiedTrainer``.
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
        sandbox = [name for name in _SANDBOX_ARGUMENTS if kwargs.get(name) is not None]
        if sandbox:
            raise NotImplementedError(
                f"backend={BACKEND_NAME!r} provisions no sandboxes: drop {', '.join(sandbox)}, or pass "
                "hooks= that set up each task's environment"
            )
        model = str(OmegaConf.select(config, "model.name", default=None) or "")
        images = modality.text_only_refusal(model, train_dataset=train_dataset, val_dataset=val_dataset)
        why = gateway.refusal(config) or images
        if why:
            raise ValueError(why)
        has_flow = kwargs.get("agent_flow") is not None
        if has_flow and kwargs.get("evaluator") is None and kwargs.get("hooks") is None:
            raise ValueError(f"backend={BACKEND_NAME!r}: agent_flow needs evaluator= (or hooks=) to score it")
        if workflow_class is None and not has_flow:
            raise ValueError(
                f"backend={BACKEND_NAME!r} needs workflow_class (an rLLM Workflow subclass) or agent_flow "
                "with evaluator="
            )
        self.config = config
        self.workflow_class = workflow_class
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.workflow_args = workflow_args or {}
        self.store = store
        self.backend_cls = backend_cls
        self.backend_args = backend_args or {}
        self.kwargs = {name: value for name, value in kwargs.items() if value is not None}

    def train(self) -> None:
        unified = require("rllm", TRAINER_MODULE)
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


def register() -> None:
    """Make rLLM's ``AgentTrainer(backend="skyrl")`` run ``SkyRLTrainerLauncher`` (the
    ``rllm_agent_trainer`` set; other backends untouched) and its ``AgentSFTTrainer(spec,
    backend="skyrl")`` run ``rllm_skyrl.sft.backend.SkyRLSFTBackend`` (the ``rllm_sft_trainer`` set);
    safe to call twice. On an rLLM version a set was not verified on, or with it turned off, it is
    skipped; ``SkyRLTrainerLauncher`` and ``SkyRLSFTBackend`` still work directly."""
    require("rllm", TRAINER_MODULE)
    compat.apply(["rllm_agent_trainer"], SkyRLTrainerLauncher)
    if compat.usable(["rllm_sft_trainer"]):  # its backend subclasses rLLM's SFTBackend: import it only then
        from rllm_skyrl.sft.backend import SkyRLSFTBackend

        compat.apply(["rllm_sft_trainer"], SkyRLSFTBackend)


def unregister() -> None:
    """Undo ``register()``: rLLM's own ``AgentTrainer`` constructor and SFT dispatch again."""
    remove()
    rllm_sft_trainer.remove()
