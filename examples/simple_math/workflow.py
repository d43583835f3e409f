"""The digit task's workflow: ask the task's question once, score the answer with a reward function.

Its episode is, as far as a trainer and the backend read it, the one rLLM's ``SimpleWorkflow`` makes
(one unnamed trajectory whose reward is the answer's, ``is_correct`` when that is positive,
``<trajectory name>_acc``; ``test_trainer_driver.py`` compares them), written against rLLM's
``Workflow`` and records (``rllm_skyrl.rllm_names``: the fallback's without rLLM), and returns it
from ``run``, which rLLM's workflow engine takes as it is. That skips ``SimpleWorkflow``'s
bookkeeping for every rollout (it keeps the step on an agent, resets the agent besides the
workflow, and deep-copies the agent's trajectory into the episode): on the quickstart's 512
two-token rollouts a step, that bookkeeping took the driver about four times as long as the rest
of rLLM's rollout handling, and no setting of rLLM's turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rllm_skyrl.rllm_names import Action, Episode, Step, TerminationReason, Trajectory, Workflow


class AskOnceWorkflow(Workflow):
    def __init__(
        self, rollout_engine: Any, reward_function: Callable[[Any, Any], Any], **kwargs: Any
    ) -> None:
        super().__init__(rollout_engine, **kwargs)
        self.reward_function = reward_function

    def reset(self, task: Any = None, uid: str | None = None) -> None:
        """The task and its id, all this workflow keeps between rollouts. rLLM's ``reset`` also walks
        the workflow's attributes, twice per rollout, for agents and environments to reset: this one
        has none, and the walk was a third of what rLLM's engine spent on the quickstart's rollouts."""
        self.task, self.uid = task, uid

    async def run(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode:
        messages = [{"role": "user", "content": task["question"]}]
        output = await self.rollout_engine.get_model_response(messages, application_id=uid, **kwargs)
        reward = float(self.reward_function(task, Action(action=output.content)).reward)
        # Ids from the rollout's own: rLLM's records otherwise draw a random UUID for each.
        step = Step(id=uid, model_output=output, reward=reward)
        trajectory = Trajectory(uid=uid, task=task, steps=[step], reward=reward)
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
