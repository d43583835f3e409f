"""Workflows (how one task becomes one episode) and the engine that runs many of them at once.

``Workflow.run(task, uid)`` is rLLM's entry point. ``WorkflowEngine.execute_tasks`` is what a
backend's ``generate_episodes`` awaits: it runs one workflow instance per rollout, at most
``n_parallel_tasks`` at a time, and names each episode ``"{task_id}:{rollout_idx}"`` where
``rollout_idx`` counts repeats of the same task id. A workflow that raises becomes an episode
with termination reason ``error`` (retried up to ``retry_limit`` times), so one bad rollout is
counted in ``batch/termination_reason/error`` instead of ending the run.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
import uuid
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rllm_skyrl import rllm_api
from rllm_skyrl.records import (
    Episode,
    ModelOutput,
    Step,
    TerminationReason,
    Trajectory,
    termination_value,
)
from rllm_skyrl.standalone.rollout_engine import RolloutEngine

logger = logging.getLogger(__name__)

RewardFn = Callable[[dict[str, Any], str], float]
# (task, response text, reward of that response) -> next user message, or None when the env is done.
FeedbackFn = Callable[[dict[str, Any], str, float], str | None]


class Workflow(ABC):
    """One rollout of one task. A fresh instance is made per rollout, so instances may keep state.

    ``timeout`` (seconds, None for no limit) bounds ``run``; extra keyword arguments are
    accepted and ignored so rLLM-style ``workflow_args`` (``executor``, ``gamma``...) do not break.
    """

    def __init__(self, rollout_engine: RolloutEngine, timeout: float | None = None, **kwargs: Any) -> None:
        self.rollout_engine = rollout_engine
        self.timeout = timeout

    @abstractmethod
    async def run(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode:
        """Roll out ``task``; ``uid`` is the episode id the engine will assign."""


def task_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The opening chat of a task row, read from the same keys rLLM's SimpleWorkflow accepts."""
    if task.get("messages") is not None:
        return [dict(m) for m in task["messages"]]
    for key in ("question", "prompt", "problem"):
        if task.get(key) is not None:
            return [{"role": "user", "content": task[key]}]
    raise ValueError(f"task has none of the keys messages/question/prompt/problem: {sorted(task)}")


def _response_text(output: ModelOutput) -> str:
    return output.content if output.content is not None else (output.text or "")


class SingleTurnWorkflow(Workflow):
    """One prompt, one response, ``reward_fn(task, text)`` as the reward; ``is_correct`` is reward > 0."""

    def __init__(
        self, rollout_engine: RolloutEngine, reward_fn: RewardFn, role: str = "agent", **kwargs: Any
    ) -> None:
        super().__init__(rollout_engine, **kwargs)
        self.reward_fn = reward_fn
        self.role = role

    async def run(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode:
        messages = task_messages(task)
        output = await self.rollout_engine.get_model_response(messages, **kwargs)
        text = _response_text(output)
        reward = float(self.reward_fn(task, text))
        step = Step(
            chat_completions=[*messages, {"role": "assistant", "content": text}],
            reward=reward,
            done=True,
            model_output=output,
        )
        reason = (
            TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED
            if output.finish_reason == "length"
            else TerminationReason.ENV_DONE
        )
        return Episode(
            id=uid,
            task=task,
            trajectories=[Trajectory(name=self.role, task=task, steps=[step], reward=reward)],
            is_correct=reward > 0,
            termination_reason=reason,
            metrics={f"{self.role}_acc": reward},
        )


def retry_until_correct(task: dict[str, Any], text: str, reward: float) -> str | None:
    """Default environment of MultiTurnWorkflow: done once solved, otherwise ask again."""
    if reward > 0:
        return None
    return "That is not correct. Check your work and answer again."


class MultiTurnWorkflow(Workflow):
    """Up to ``max_turns`` model turns with environment feedback in between.

    Every turn is a Step whose prompt is the whole conversation so far (the engine templates
    the full message list), so each step's prompt extends the previous step's prompt and
    response; the backend can merge them into one training row. Step rewards are
    ``reward_fn`` on that turn's response; the trajectory reward is the final turn's.
    """

    def __init__(
        self,
        rollout_engine: RolloutEngine,
        reward_fn: RewardFn,
        feedback_fn: FeedbackFn = retry_until_correct,
        max_turns: int = 2,
        role: str = "agent",
        **kwargs: Any,
    ) -> None:
        super().__init__(rollout_engine, **kwargs)
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.reward_fn = reward_fn
        self.feedback_fn = feedback_fn
        self.max_turns = max_turns
        self.role = role

    async def run(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode:
        messages = task_messages(task)
        steps: list[Step] = []
        reason = TerminationReason.MAX_TURNS_EXCEEDED
        for turn in range(self.max_turns):
            output = await self.rollout_engine.get_model_response(messages, **kwargs)
            text = _response_text(output)
            reward = float(self.reward_fn(task, text))
            messages = [*messages, {"role": "assistant", "content": text}]
            steps.append(Step(chat_completions=list(messages), reward=reward, model_output=output))
            if output.finish_reason == "length":
                reason = TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED
                break
            feedback = self.feedback_fn(task, text, reward)
            if feedback is None:
                reason = TerminationReason.ENV_DONE
                break
            if turn + 1 < self.max_turns:
                messages = [*messages, {"role": "user", "content": feedback}]
        steps[-1].done = True
        final_reward = steps[-1].reward
        return Episode(
            id=uid,
            task=task,
            trajectories=[Trajectory(name=self.role, task=task, steps=steps, reward=final_reward)],
            is_correct=final_reward > 0,
            termination_reason=reason,
            metrics={f"{self.role}_acc": final_reward, "num_turns": len(steps)},
        )


def repeat_tasks(batch: Sequence[dict[str, Any]], n: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Each task ``n`` times in a row, with one shared id per task (its ``id`` field, else a uuid).

    The shared id is what groups the ``n`` rollouts for advantage estimation and pass@k.
    """
    tasks: list[dict[str, Any]] = []
    task_ids: list[str] = []
    for task in batch:
        task_id = str(task["id"]) if task.get("id") not in (None, "") else str(uuid.uuid4())
        tasks.extend([task] * n)
        task_ids.extend([task_id] * n)
    return tasks, task_ids


class WorkflowEngine:
    """Runs ``workflow_cls(rollout_engine=..., **workflow_args)`` once per rollout, concurrently."""

    def __init__(
        self,
        workflow_cls: type[Workflow],
        workflow_args: dict[str, Any] | None,
        rollout_engine: RolloutEngine,
        n_parallel_tasks: int = 128,
        retry_limit: int = 1,
        raise_on_error: bool = False,
    ) -> None:
        if n_parallel_tasks < 1 or retry_limit < 1:
            raise ValueError(
                f"n_parallel_tasks ({n_parallel_tasks}) and retry_limit ({retry_limit}) must be >= 1"
            )
        self.workflow_cls = workflow_cls
        self.workflow_args = dict(workflow_args or {})
        self.rollout_engine = rollout_engine
        self.n_parallel_tasks = n_parallel_tasks
        self.retry_limit = retry_limit
        self.raise_on_error = raise_on_error
        self._executor: ThreadPoolExecutor | None = None  # environment calls of rLLM workflows

    async def execute_tasks(
        self,
        tasks: Sequence[dict[str, Any]],
        task_ids: Sequence[str] | None = None,
        is_validation: bool = False,
        **kwargs: Any,
    ) -> list[Episode]:
        """One episode per task, in input order. ``kwargs`` are passed on to ``Workflow.run``."""
        self.rollout_engine.is_validation = is_validation
        if task_ids is None:
            task_ids = [str(uuid.uuid4()) for _ in tasks]
        if len(task_ids) != len(tasks):
            raise ValueError(f"{len(tasks)} tasks but {len(task_ids)} task ids")
        seen: dict[str, int] = defaultdict(int)
        uids = []
        for task_id in task_ids:
            uids.append(f"{task_id}:{seen[task_id]}")
            seen[task_id] += 1
        limit = asyncio.Semaphore(self.n_parallel_tasks)
        rollouts = (self._rollout(limit, task, uid, kwargs) for task, uid in zip(tasks, uids, strict=True))
        return list(await asyncio.gather(*rollouts))

    async def _rollout(
        self, limit: asyncio.Semaphore, task: dict[str, Any], uid: str, kwargs: dict[str, Any]
    ) -> Episode:
        async with limit:
            for attempt in range(1, self.retry_limit + 1):
                episode = await self._run_once(task, uid, kwargs)
                if termination_value(episode.termination_reason) != TerminationReason.ERROR.value:
                    break
                error = episode.metadata["error"]
                logger.warning(
                    "rollout %s failed (attempt %d/%d): %s: %s",
                    uid,
                    attempt,
                    self.retry_limit,
                    error["error_type"],
                    error["error_message"],
                )
            else:
                if self.raise_on_error:
                    raise RuntimeError(
                        f"rollout {uid} failed {self.retry_limit} times:\n{error['traceback']}"
                    )
        # The engine, not the workflow, owns the id: grouping and pass@k rely on it.
        episode.id = uid
        episode.task = task
        return episode

    async def _run_once(self, task: dict[str, Any], uid: str, kwargs: dict[str, Any]) -> Episode:
        if rllm_api.is_rllm_workflow(self.workflow_cls):
            return await self._run_rllm_workflow(task, uid, kwargs)
        workflow = self.workflow_cls(rollout_engine=self.rollout_engine, **self.workflow_args)
        try:
            episode = await asyncio.wait_for(workflow.run(task, uid, **kwargs), timeout=workflow.timeout)
        except TimeoutError:
            return Episode(id=uid, task=task, termination_reason=TerminationReason.TIMEOUT)
        except Exception as exc:
            reason = getattr(exc, "reason", None)  # a TerminationEvent (ours or rLLM's)
            if reason is not None and str(getattr(reason, "value", reason)) in set(TerminationReason):
                return Episode(
                    id=uid,
                    task=task,
                    termination_reason=TerminationReason(str(getattr(reason, "value", reason))),
                )
            error = {
                "error_type": type(exc).__name__,
                "error_message": str(exc),
                "traceback": traceback.format_exc(),
            }
            return Episode(
                id=uid, task=task, termination_reason=TerminationReason.ERROR, metadata={"error": error}
            )
        if not isinstance(episode, Episode):
            raise TypeError(
                f"{self.workflow_cls.__name__}.run returned {type(episode).__name__}, expected an Episode"
            )
        return episode

    async def _run_rllm_workflow(self, task: Any, uid: str, kwargs: dict[str, Any]) -> Any:
        """An rLLM ``Workflow``, run as rLLM's workflow engine runs it: its own termination handling
        turns a ``TerminationEvent``, a timeout or an exception into the episode's reason."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.n_parallel_tasks)
        workflow = self.workflow_cls(
            rollout_engine=self.rollout_engine, executor=self._executor, **self.workflow_args
        )
        workflow.reset(task, uid)
        return await workflow.run_with_termination_handling(task, uid, **kwargs)
