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

# name: (rLLM's class, the stand-in)
NAMES = {
    "UnifiedTrainer": (
        "rllm.trainer.unified_trainer.UnifiedTrainer",
        "rllm_skyrl.standalone.driver.UnifiedTrainer",
    ),
    "Workflow": ("rllm.workflows.workflow.Workflow", "rllm_skyrl.standalone.workflow.Workflow"),
    "SimpleWorkflow": (
        "rllm.workflows.simple_workflow.SimpleWorkflow",
        "rllm_skyrl.standalone.workflow.SimpleWorkflow",
    ),
    "TerminationEvent": ("rllm.workflows.workflow.TerminationEvent", "rllm_skyrl.records.TerminationEvent"),
    "TerminationReason": (
        "rllm.workflows.workflow.TerminationReason",
        "rllm_skyrl.records.TerminationReason",
    ),
    "Episode": ("rllm.types.Episode", "rllm_skyrl.records.Episode"),
    "Trajectory": ("rllm.types.Trajectory", "rllm_skyrl.records.Trajectory"),
    "Step": ("rllm.types.Step", "rllm_skyrl.records.Step"),
    "Action": ("rllm.types.Action", "rllm_skyrl.records.Action"),
    "RewardOutput": ("rllm.rewards.reward_types.RewardOutput", "rllm_skyrl.records.RewardOutput"),
}
_NAME_OF_RLLM_PATH = {rllm_path: name for name, (rllm_path, _) in NAMES.items()}


def _load(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def resolve(target: str | type) -> Any:
    """A class given as itself or as a dotted path; one of rLLM's paths in ``NAMES`` names the
    stand-in when rLLM is not installed."""
    if not isinstance(target, str):
        return target
    if target in _NAME_OF_RLLM_PATH and not rllm_api.installed():
        return _load(NAMES[_NAME_OF_RLLM_PATH[target]][1])
    return _load(target)


def __getattr__(name: str) -> Any:
    if name not in NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _load(NAMES[name][0 if rllm_api.installed() else 1])
    globals()[name] = value
    return value
