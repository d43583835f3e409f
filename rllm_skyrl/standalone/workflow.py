"""rLLM's ``Workflow`` and ``SimpleWorkflow`` for machines without rLLM, and the engine that runs them.

The stand-ins take rLLM's constructor arguments and ``SimpleWorkflow`` calls its reward function as
rLLM's does (``reward_function(task, action)``, the answer in ``action.action``), so one workflow
class written against ``rllm_skyrl.rllm_names`` runs under either trainer. The engine drives a
workflow as rLLM's ``UnifiedWorkflowEngine`` does (``reset``, then ``run_with_termination_handling``),
so rLLM's own workflow classes run here too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import traceback
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rllm_skyrl.records import Action, Episode, Step, TerminationReason, Trajectory, termination_value

logger = logging.getLogger(__name__)


def task_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The opening chat of a task row, from the keys rLLM's ``SimpleWorkflow`` reads."""
    if task.get("messages") is not None:
        return list(task["messages"])
    for key in ("question", "prompt", "problem"):
        if task.get(key) is not None:
            return [{"role": "user", "content": task[key]}]
    raise ValueError("No question, problem, messages, or prompt key found in task")


class Workflow(ABC):
    """One rollout of one task: ``run(task, uid)`` returns an ``Episode`` or raises ``TerminationEvent``."""

    def __init__(
        self,
        rollout_engine: Any,
        executor: ThreadPoolExecutor | None = None,
        timeout: float = 1e6,
        **kwargs: Any,
    ) -> None:
        self.rollout_engine = rollout_engine
        self.executor = executor
        self.timeout = timeout

    def reset(self, task: Any = None, uid: str | None = None) -> None:
        self.task, self.uid = task, uid

    @abstractmethod
    async def run(self, task: Any, uid: str, **kwargs: Any) -> Episode | None:
        """Roll out ``task``; ``uid`` is ``"{task_id}:{rollout_idx}"``."""

    async def run_with_termination_handling(self, task: Any, uid: str, **kwargs: Any) -> Episode:
        """``run``, with a timeout, a ``TerminationEvent`` or an exception ending the episode with that
        reason (rLLM's semantics): one bad rollout is counted, not fatal."""
        try:
            episode = await asyncio.wait_for(self.run(task, uid, **kwargs), timeout=self.timeout)
        except TimeoutError:
            return Episode(id=uid, task=task, termination_reason=TerminationReason.TIMEOUT)
        except Exception as error:
            reason = getattr(error, "reason", None)  # a TerminationEvent, ours or rLLM's
            if reason is not None and termination_value(reason) in set(TerminationReason):
                return Episode(
                    id=uid, task=task, termination_reason=TerminationReason(termination_value(reason))
                )
            details = {"error_type": type(error).__name__, "error_message": str(error)}
            details["traceback"] = traceback.format_exc()
            return Episode(
                id=uid, task=task, termination_reason=TerminationReason.ERROR, metadata={"error": details}
            )
        if not isinstance(episode, Episode):
            raise TypeError(
                f"{type(self).__name__}.run returned {type(episode).__name__}, expected an Episode"
            )
        return episode


class SimpleWorkflow(Workflow):
    """rLLM's ``SimpleWorkflow``: one question, one answer, and the episode rLLM's version makes."""

    def __init__(
        self, rollout_engine: Any, reward_function: Callable[[Any, Action], Any], **kwargs: Any
    ) -> None:
        super().__init__(rollout_engine, **kwargs)
        self.reward_function = reward_function

    async def run(self, task: Any, uid: str, **kwargs: Any) -> Episode:
        messages = task_messages(task)
        output = await self.rollout_engine.get_model_response(messages, application_id=uid, **kwargs)
        reward = float(self.reward_function(task, Action(action=output.content)).reward)
        step = Step(
            chat_completions=[*messages, {"role": "assistant", "content": output.content}],
            reward=reward,
            model_output=output,
        )
        trajectory = Trajectory(task=task, steps=[step], reward=reward)
        truncated = output.finish_reason == "length"
        return Episode(
            id=uid,
            task=task,
            trajectories=[trajectory],
            is_correct=reward > 0,
            termination_reason=(
                TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED if truncated else TerminationReason.ENV_DONE
            ),
            metrics={f"{trajectory.name}_acc": reward},
        )


class WorkflowEngine:
    """Runs one workflow per rollout, at most ``n_parallel_tasks`` at a time (rLLM's ``execute_tasks``);
    a rollout that ends in error is tried up to ``retry_limit`` times, then counted (or raised)."""

    def __init__(
        self,
        workflow_cls: type,
        workflow_args: dict[str, Any] | None,
        rollout_engine: Any,
        n_parallel_tasks: int = 256,
        retry_limit: int = 1,
        raise_on_error: bool = False,
    ) -> None:
        self.workflow_cls = workflow_cls
        self.workflow_args = dict(workflow_args or {})
        self.rollout_engine = rollout_engine
        self.n_parallel_tasks = n_parallel_tasks
        self.retry_limit = retry_limit
        self.raise_on_error = raise_on_error
        self.executor = ThreadPoolExecutor(max_workers=n_parallel_tasks)  # rLLM workflows' blocking calls

    async def execute_tasks(
        self, tasks: Sequence[Any], task_ids: Sequence[str], is_validation: bool = False, **kwargs: Any
    ) -> list[Episode]:
        """One episode per task, in input order; ``kwargs`` reach each workflow's ``run``."""
        self.rollout_engine.is_validation = is_validation
        rollout_index: dict[str, Iterator[int]] = defaultdict(itertools.count)  # per task id: 0, 1, ...
        uids = [f"{task_id}:{next(rollout_index[task_id])}" for task_id in task_ids]
        limit = asyncio.Semaphore(self.n_parallel_tasks)
        rollouts = (self._rollout(limit, task, uid, kwargs) for task, uid in zip(tasks, uids, strict=True))
        return list(await asyncio.gather(*rollouts))

    async def _rollout(
        self, limit: asyncio.Semaphore, task: Any, uid: str, kwargs: dict[str, Any]
    ) -> Episode:
        async with limit:
            for attempt in range(1, self.retry_limit + 1):
                workflow = self.workflow_cls(
                    rollout_engine=self.rollout_engine, executor=self.executor, **self.workflow_args
                )
                workflow.reset(task=task, uid=uid)
                episode = await workflow.run_with_termination_handling(task=task, uid=uid, **kwargs)
                if termination_value(episode.termination_reason) != TerminationReason.ERROR.value:
                    break
                error = episode.metadata.get("error", {})
                logger.warning(
                    "rollout %s failed (attempt %d/%d): %s: %s",
                    uid,
                    attempt,
                    self.retry_limit,
                    error.get("error_type"),
                    error.get("error_message"),
                )
            else:
                if self.raise_on_error:
                    raise RuntimeError(
                        f"rollout {uid} failed {self.retry_limit} times:\n{error.get('traceback')}"
                    )
        episode.id, episode.task = uid, task  # the engine owns the id: grouping and pass@k rely on it
        return episode

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)
