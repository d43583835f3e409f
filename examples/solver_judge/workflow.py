"""Solver-judge: a solver proposes answers, a judge picks one; both roles train the same policy.

Each solver attempt is its own trajectory (role ``solver``, rewarded for being right); the judge
is one trajectory (role ``judge``, rewarded when the answer it picks is right). The trainer groups
trajectories by task and role, so advantages compare solvers with solvers and judges with judges.
Written against rLLM's ``Workflow`` and records (``rllm_skyrl.rllm_names``: the fallback's without rLLM).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from examples.simple_math.task import reward_fn
from rllm_skyrl.rllm_names import Episode, Step, TerminationReason, Trajectory, Workflow

_NUMBER = re.compile(r"\d+")


def judge_prompt(question: str, candidates: list[str]) -> str:
    listed = " ".join(f"{i + 1}) {c.strip() or '?'}" for i, c in enumerate(candidates))
    return f"{question} choose the correct answer: {listed}"


def picked_answer(text: str, candidates: list[str]) -> str | None:
    """The judge answers with an option number; anything else picks nothing."""
    match = _NUMBER.match(text)
    if match is None or not 1 <= int(match.group(0)) <= len(candidates):
        return None
    return candidates[int(match.group(0)) - 1]


class SolverJudgeWorkflow(Workflow):
    def __init__(self, rollout_engine: Any, num_solutions: int = 2, **kwargs: Any) -> None:
        super().__init__(rollout_engine, **kwargs)
        self.num_solutions = num_solutions

    def _content(self, output: Any) -> str:
        return output.content if output.content is not None else (output.text or "")

    async def run(self, task: dict[str, Any], uid: str, **kwargs: Any) -> Episode:
        messages = [{"role": "user", "content": task["question"]}]
        attempts = await asyncio.gather(
            *(self.rollout_engine.get_model_response(messages, **kwargs) for _ in range(self.num_solutions))
        )
        candidates = [self._content(o) for o in attempts]
        solvers = []
        for output, text in zip(attempts, candidates, strict=True):
            reward = reward_fn(task, text)
            solvers.append(
                Trajectory(
                    name="solver", task=task, steps=[Step(model_output=output, reward=reward)], reward=reward
                )
            )

        judge_messages = [{"role": "user", "content": judge_prompt(task["question"], candidates)}]
        verdict = await self.rollout_engine.get_model_response(judge_messages, **kwargs)
        picked = picked_answer(self._content(verdict), candidates)
        judge_reward = float(picked is not None and reward_fn(task, picked) > 0)
        judge = Trajectory(
            name="judge",
            task=task,
            steps=[Step(model_output=verdict, reward=judge_reward)],
            reward=judge_reward,
        )
        return Episode(
            id=uid,
            task=task,
            trajectories=[*solvers, judge],
            is_correct=judge_reward > 0,
            termination_reason=TerminationReason.ENV_DONE,
            metrics={"solver_acc": sum(t.reward for t in solvers) / len(solvers), "judge_acc": judge_reward},
        )
