"""The digit task as an rLLM AgentFlow and Evaluator, the way rLLM teaches training.

The flow asks the task's question over OpenAI's chat API at ``config.base_url``: rLLM's model
gateway, which forwards the call to the inference servers and records the token ids and logprobs
they sampled, from which the trainer builds the training step. The evaluator scores the answer
(``task.reward_fn``). Sampling params are the gateway's (the run's ``rllm.rollout``), not the flow's.
"""

from __future__ import annotations

import asyncio
from typing import Any

import rllm
from openai import AsyncOpenAI
from rllm.eval.types import EvalOutput
from rllm.types import AgentConfig, Episode, Step, Task, Trajectory

from examples.simple_math.task import reward_fn

# One client (one connection pool) per event loop; every rollout has its own session URL.
_clients: dict[int, AsyncOpenAI] = {}


def _client(base_url: str) -> AsyncOpenAI:
    loop = id(asyncio.get_running_loop())
    if loop not in _clients:
        _clients.clear()  # a client from a finished loop cannot be used in this one
        _clients[loop] = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    return _clients[loop].with_options(base_url=base_url)


def _question(task: Any) -> dict[str, Any]:
    return task.metadata if isinstance(task, Task) else task


@rllm.rollout(name="digit")
async def digit_flow(task: Task, config: AgentConfig) -> Episode:
    messages = [{"role": "user", "content": _question(task)["question"]}]
    response = await _client(config.base_url).chat.completions.create(model=config.model, messages=messages)
    answer = response.choices[0].message.content or ""
    step = Step(chat_completions=[*messages, {"role": "assistant", "content": answer}], action=answer)
    return Episode(trajectories=[Trajectory(name="digit", steps=[step])], artifacts={"answer": answer})


@rllm.evaluator
def digit_evaluator(task: Any, episode: Episode) -> EvalOutput:
    reward = reward_fn(_question(task), episode.artifacts.get("answer", ""))
    return EvalOutput(reward=reward, is_correct=reward > 0)
