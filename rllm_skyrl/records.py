"""rLLM's records (steps, trajectories, episodes, groups, model outputs, rewards) for code without rLLM.

Field names follow ``rllm.types`` / ``rllm.engine.rollout.ModelOutput`` exactly. Plain dataclasses,
not pydantic: nothing needs validation beyond the logprob/token length check that guards every row.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

# rLLM's name for a trajectory nobody named; the driver renames such trajectories per position.
DEFAULT_TRAJECTORY_NAME = "default_traj_name"


class TerminationReason(StrEnum):
    """Why an episode ended (values are rLLM's, so metric names match across backends)."""

    MAX_PROMPT_LENGTH_EXCEEDED = "max_prompt_length_exceeded"
    MAX_RESPONSE_LENGTH_EXCEEDED = "max_response_length_exceeded"
    ENV_DONE = "env_done"
    MAX_TURNS_EXCEEDED = "max_turns_exceeded"
    TIMEOUT = "timeout"
    UNKNOWN = "unknown"
    ERROR = "error"


def termination_value(reason: Any) -> str:
    """A termination reason as its string value, whether ours, rLLM's (a plain ``Enum``) or None."""
    return str(getattr(reason, "value", reason) or TerminationReason.UNKNOWN.value)


class TerminationEvent(Exception):
    """Raised to end a rollout early; the workflow engine reads ``.reason`` from it or rLLM's own."""

    def __init__(self, reason: str):
        super().__init__(f"Terminated: {reason}")
        self.reason = reason


@dataclass
class Action:
    """What the model did in a step, as rLLM's workflows hand it to a reward function (``.action``)."""

    action: Any = None


@dataclass
class RewardOutput:
    """A reward function's result (``rllm.rewards.reward_types.RewardOutput``)."""

    reward: float
    metadata: dict[str, Any] = field(default_factory=dict)
    is_correct: bool | None = None


@dataclass
class ToolCall:
    """A function call the model emitted (Hermes/Qwen ``<tool_call>{json}</tool_call>`` format)."""

    name: str
    arguments: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ModelOutput:
    """One sampled completion as a rollout engine returns it (token ids are the source of truth)."""

    text: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[Any] | None = None
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    prompt_length: int = 0
    completion_length: int = 0
    finish_reason: str | None = None
    weight_version: int | None = None
    metrics: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tool_calls"] = [c.to_dict() if hasattr(c, "to_dict") else c for c in self.tool_calls or []]
        return out


@dataclass
class Step:
    """One model call: the tokens it saw, the tokens it sampled (with their logprobs) and a reward.

    Token fields left empty are filled from ``model_output``, as rLLM does, so a workflow can
    build a step from the engine's output alone.
    """

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    advantage: float | list[float] | None = None
    model_output: ModelOutput | None = None
    chat_completions: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    weight_version: int | None = None
    id: str = field(default_factory=lambda: str(uuid.uuid4()))

    def __post_init__(self) -> None:
        out = self.model_output
        if out is not None:
            if not self.prompt_ids and out.prompt_ids is not None:
                self.prompt_ids = list(out.prompt_ids)
            if not self.response_ids and out.completion_ids is not None:
                self.response_ids = list(out.completion_ids)
            if not self.logprobs and out.logprobs is not None:
                self.logprobs = list(out.logprobs)
            if self.weight_version is None:
                self.weight_version = out.weight_version
        if self.logprobs and len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"step has {len(self.logprobs)} logprobs for {len(self.response_ids)} response tokens; "
                "the rollout engine must return one logprob per sampled token"
            )


@dataclass
class Trajectory:
    """The steps of one agent (``name`` is its role) within an episode."""

    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    name: str = DEFAULT_TRAJECTORY_NAME
    task: Any = None
    steps: list[Step] = field(default_factory=list)
    reward: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _split_id(composite_id: str) -> tuple[str, str]:
    """Split ``"<task_id>:<suffix>"`` at the last colon, so task ids may themselves contain colons."""
    head, sep, tail = composite_id.rpartition(":")
    return (head, tail) if sep else (composite_id, "")


@dataclass
class Episode:
    """Everything one rollout of one task produced; ``id`` is ``"{task_id}:{rollout_idx}"``."""

    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    task: Any = None
    trajectories: list[Trajectory] = field(default_factory=list)
    is_correct: bool = False
    termination_reason: TerminationReason | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def task_id(self) -> str:
        return _split_id(self.id)[0]

    @property
    def rollout_idx(self) -> str:
        return _split_id(self.id)[1]


@dataclass
class TrajectoryGroup:
    """Trajectories whose rewards are compared (same task, same role); ``group_id`` is
    ``"{task_id}:{role}"``, ``metadata`` one dict per trajectory."""

    trajectories: list[Trajectory]
    group_id: str = ""
    metadata: list[dict[str, Any]] = field(default_factory=list)

    @property
    def group_role(self) -> str:
        return _split_id(self.group_id)[1] or "all_groups"

    @property
    def task_id(self) -> str:
        return _split_id(self.group_id)[0]
