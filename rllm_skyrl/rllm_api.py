"""rLLM's own pieces when rLLM is installed, this package's equivalents when it is not.

rLLM is optional (it is not on PyPI). Where an rLLM user must get exactly what rLLM's other backends
give them (its ``ModelOutput`` and ``TerminationEvent`` classes, its chat-template parser, its
advantage estimators and registry, its task ids), this module imports rLLM's; without rLLM the
``rllm_skyrl.records`` stand-ins and the standalone trainer's own implementations stand in. Besides
it, only ``rllm_names`` (what training code names) and ``rllm_plugin`` (rLLM's ``AgentTrainer``)
import ``rllm``.
"""

from __future__ import annotations

import functools
import importlib.util
import uuid
from collections.abc import Sequence
from typing import Any

from rllm_skyrl import records


@functools.cache
def installed() -> bool:
    return importlib.util.find_spec("rllm") is not None


def model_output_class() -> type:
    """The ``ModelOutput`` rLLM's workflows expect (``rllm.engine.rollout.rollout_engine``)."""
    if installed():
        from rllm.engine.rollout.rollout_engine import ModelOutput

        return ModelOutput
    return records.ModelOutput


def tool_call(name: str, arguments: dict[str, Any]) -> Any:
    """A parsed tool call as rLLM's ``ToolCall`` (``rllm.tools.tool_base``) or ours."""
    if installed():
        from rllm.tools.tool_base import ToolCall

        return ToolCall(name=name, arguments=arguments)
    return records.ToolCall(name=name, arguments=arguments)


def termination_event(reason: str) -> Exception:
    """``TerminationEvent(TerminationReason(reason))``: rLLM's workflow engine catches its own class."""
    if installed():
        from rllm.workflows.workflow import TerminationEvent, TerminationReason

        return TerminationEvent(TerminationReason(reason))
    return records.TerminationEvent(reason)


def chat_parser(tokenizer: Any, disable_thinking: bool = False) -> Any:
    """rLLM's chat-template parser for this tokenizer (what rLLM's verl engine builds), or None.

    rLLM picks the parser from the tokenizer's name and class (Qwen/ChatML, Llama, ...) and, for an
    unknown template, asserts that the generic parser renders turn by turn what the template renders
    whole; that assertion is left to surface, with the model named, when a workflow asks for it.
    """
    if not installed():
        return None
    from rllm.parser import ChatTemplateParser

    try:
        return ChatTemplateParser.get_parser(tokenizer, disable_thinking=disable_thinking)
    except AssertionError as error:
        raise ValueError(
            f"rLLM has no chat-template parser that reproduces the template of {tokenizer.name_or_path!r} "
            "turn by turn; workflows that render prompts with rollout_engine.chat_parser (e.g. "
            "CumulativeWorkflow) cannot run with this model"
        ) from error


def task_ids(batch: Sequence[Any], group_size: int) -> tuple[list[Any], list[str]]:
    """Each task ``group_size`` times in a row, with one id per task, exactly as rLLM's backends do.

    ``Task`` objects keep their ``id``; dict rows their ``"id"``; a task without one gets a fresh
    uuid (rLLM's ``interleave_tasks``).
    """
    tasks: list[Any] = []
    ids: list[str] = []
    for item in batch:
        item_id = item.get("id") if isinstance(item, dict) else getattr(item, "id", None)
        task_id = str(item_id) if item_id else str(uuid.uuid4())
        tasks.extend([item] * group_size)
        ids.extend([task_id] * group_size)
    return tasks, ids


def task_field(task: Any, name: str) -> Any:
    """A field of a dict row, or of a ``Task``'s metadata (rLLM's ``load_dataset(as_tasks=True)``)."""
    if isinstance(task, dict):
        return task.get(name)
    return (getattr(task, "metadata", None) or {}).get(name)


def is_rllm_algorithm_config(algorithm_config: Any) -> bool:
    """Whether the trainer handed us rLLM's ``AlgorithmConfig`` (so rLLM's estimators apply)."""
    return installed() and type(algorithm_config).__module__.startswith("rllm.")


def rllm_advantages(groups: Sequence[Any], algorithm_config: Any) -> dict[str, float]:
    """rLLM's advantages (its registry, per-role estimator map, formulas), written onto every step.

    ``collect_reward_and_advantage_from_trajectory_groups`` is what rLLM's tinker backend and the
    trainer's default ``compute_advantages`` call; it sets ``step.advantage`` in place and returns
    rLLM's ``reward/<role>/*``, ``advantage/<role>/*`` and ``batch/<role>/*`` metrics.
    """
    from rllm.trainer.algorithms import collect_reward_and_advantage_from_trajectory_groups

    return collect_reward_and_advantage_from_trajectory_groups(list(groups), algorithm_config)
