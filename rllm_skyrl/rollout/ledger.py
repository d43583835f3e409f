"""What the policy actually sampled, per rollout, so steps that lost their tokens can be trained on.

rLLM's agent/environment workflows (``MultiTurnWorkflow``, ``CumulativeWorkflow``,
``SingleTurnWorkflow``) hand the agent only ``output.text``, so its steps lack the ids and logprobs
training needs (rLLM's other backends skip them). The engine records every call under the rollout's
``application_id`` (rLLM passes the episode id ``"task:rollout"``), and ``restore_step_tokens`` puts
the tokens back, matching steps to calls by text: nothing is re-tokenised.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Rollouts remembered at once; the oldest are forgotten first (a rollout whose episode was filtered
# out by the trainer is never claimed).
MAX_ROLLOUTS = 65_536


@dataclass(frozen=True)
class SampledCall:
    """One model call of one rollout: the exact tokens in and out, and the text they decode to."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    content: str
    weight_version: int


class RolloutLedger:
    """Calls by rollout id (``application_id``), in the order they were made."""

    def __init__(self) -> None:
        self._calls: OrderedDict[str, list[SampledCall]] = OrderedDict()

    def record(self, rollout_id: str | None, output: Any) -> None:
        if rollout_id is None or output.logprobs is None:
            return
        self._calls.setdefault(str(rollout_id), []).append(
            SampledCall(
                prompt_ids=tuple(output.prompt_ids),
                completion_ids=tuple(output.completion_ids),
                logprobs=tuple(output.logprobs),
                text=output.text or "",
                content=output.content or "",
                weight_version=int(output.weight_version or 0),
            )
        )
        while len(self._calls) > MAX_ROLLOUTS:
            self._calls.popitem(last=False)

    def calls(self, rollout_id: str) -> list[SampledCall]:
        return self._calls.get(str(rollout_id), [])

    def forget(self, rollout_ids: set[str]) -> None:
        for rollout_id in rollout_ids:
            self._calls.pop(rollout_id, None)


def _step_text(step: Any) -> str | None:
    """What the model said at this step, as the agent recorded it."""
    response = getattr(step, "model_response", None)
    if response:
        return response
    messages = getattr(step, "chat_completions", None) or []
    if messages and messages[-1].get("role") == "assistant":
        return messages[-1].get("content")
    return None


def _rollout_id(group: Any, index: int) -> str | None:
    metadata = list(getattr(group, "metadata", None) or [])
    meta = metadata[index] if index < len(metadata) and isinstance(metadata[index], dict) else {}
    if meta.get("task_id") is None or meta.get("rollout_idx") is None:
        return None
    return f"{meta['task_id']}:{meta['rollout_idx']}"


def _first_unused_call(text: str | None, calls: list[SampledCall], used: set[int]) -> int | None:
    """The first call not yet used whose text or content is ``text``; a step without text has none."""
    if text is None:
        return None
    unused = (i for i, call in enumerate(calls) if i not in used)
    return next((i for i in unused if text in (calls[i].text, calls[i].content)), None)


def restore_step_tokens(groups: Sequence[Any], ledger: RolloutLedger) -> tuple[int, int]:
    """Fill the token fields of steps that have none; ``(restored, unmatched)`` step counts. Agents
    (trajectories) of one rollout share its calls, each used once; the ledger then forgets them."""
    restored = unmatched = 0
    used_by_rollout: dict[str, set[int]] = {}
    for group in groups:
        for index, trajectory in enumerate(group.trajectories):
            missing = [step for step in trajectory.steps or [] if not getattr(step, "response_ids", None)]
            rollout_id = _rollout_id(group, index)
            if rollout_id is not None:
                used = used_by_rollout.setdefault(rollout_id, set())
            if not missing or rollout_id is None:
                unmatched += len(missing)
                continue
            calls = ledger.calls(rollout_id)
            texts = [_step_text(step) for step in missing]
            in_order = all(text is None for text in texts) and len(calls) == len(missing) and not used
            for position, (step, text) in enumerate(zip(missing, texts, strict=True)):
                match = position if in_order else _first_unused_call(text, calls, used)
                if match is None:
                    unmatched += 1
                    continue
                used.add(match)
                call = calls[match]
                step.prompt_ids = list(call.prompt_ids)
                step.response_ids = list(call.completion_ids)
                step.logprobs = list(call.logprobs)
                step.weight_version = call.weight_version
                restored += 1
    ledger.forget(set(used_by_rollout))
    return restored, unmatched
