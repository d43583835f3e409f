"""rLLM's own pieces when rLLM is installed, this package's equivalents when it is not.

rLLM is optional (it is not on PyPI). Where an rLLM user must get exactly what rLLM's other backends
give (``ModelOutput`` and ``TerminationEvent``, the chat-template parser, advantage estimators, task
ids), rLLM's are used, else ``rllm_skyrl.records`` and the standalone trainer's. Besides this module,
only ``rllm_names`` and ``rllm_plugin`` import ``rllm``.
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
    """rLLM's chat-template parser for this tokenizer (what rLLM's verl engine builds), or None. For
    an unknown template rLLM asserts its generic parser renders it turn by turn as the template does
    whole; that failure is raised with the model named."""
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
    """Each task ``group_size`` times in a row with one id per task, as rLLM's ``interleave_tasks``:
    a ``Task``'s ``id``, a dict row's ``"id"``, else a fresh uuid."""
    tasks: list[Any] = []
    ids: list[str] = []
    for item in batch:
        item_id = item.get("id") if isinstance(item, dict) else getattr(item, "id", None)
        tasks += [item] * group_size
        ids += [str(item_id) if item_id else str(uuid.uuid4())] * group_size
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
    """rLLM's advantages set on every step in place, as rLLM's tinker backend and default
    ``compute_advantages`` compute them; returns rLLM's ``reward/``, ``advantage/``, ``batch/<role>/*``."""
    from rllm.trainer.algorithms import collect_reward_and_advantage_from_trajectory_groups

    return collect_reward_and_advantage_from_trajectory_groups(list(groups), algorithm_config)
