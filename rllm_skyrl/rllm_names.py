"""rLLM's names for training code: rLLM's own classes when rLLM is installed, the fallback's when not.

A training script takes its trainer, workflows, records and reward type from here and runs
unchanged either way (the stand-ins take the same arguments and have the same fields).

Names resolve on first use: rLLM's trainer package takes one to two seconds to import, better spent
after the run has launched Ray (``training_run.train``) than while the script is imported. For the
same reason ``training_run.train`` takes a workflow class as a dotted path, rLLM's included, which
``resolve`` maps to the stand-in where rLLM is not installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from rllm_skyrl import rllm_api

# name: (rLLM's module, the stand-in's module); the class is called ``name`` in both
NAMES = {
    "UnifiedTrainer": ("rllm.trainer.unified_trainer", "rllm_skyrl.standalone.driver"),
    "Workflow": ("rllm.workflows.workflow", "rllm_skyrl.standalone.workflow"),
    "SimpleWorkflow": ("rllm.workflows.simple_workflow", "rllm_skyrl.standalone.workflow"),
    "TerminationEvent": ("rllm.workflows.workflow", "rllm_skyrl.records"),
    "TerminationReason": ("rllm.workflows.workflow", "rllm_skyrl.records"),
    "Episode": ("rllm.types", "rllm_skyrl.records"),
    "Trajectory": ("rllm.types", "rllm_skyrl.records"),
    "Step": ("rllm.types", "rllm_skyrl.records"),
    "Action": ("rllm.types", "rllm_skyrl.records"),
    "RewardOutput": ("rllm.rewards.reward_types", "rllm_skyrl.records"),
}
_NAME_OF_RLLM_PATH = {f"{rllm_module}.{name}": name for name, (rllm_module, _) in NAMES.items()}


def _load(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def resolve(target: str | type) -> Any:
    """A class given as itself or as a dotted path; one of rLLM's paths in ``NAMES`` names the
    stand-in when rLLM is not installed."""
    if not isinstance(target, str):
        return target
    name = _NAME_OF_RLLM_PATH.get(target)
    if name is not None and not rllm_api.installed():
        return _load(NAMES[name][1], name)
    module, _, name = target.rpartition(".")
    return _load(module, name)


def __getattr__(name: str) -> Any:
    if name not in NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _load(NAMES[name][0 if rllm_api.installed() else 1], name)
    globals()[name] = value
    return value
