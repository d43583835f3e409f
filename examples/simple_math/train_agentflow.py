"""GRPO on the digit task as rLLM teaches training: an AgentFlow plus an Evaluator (``flow.py``).

rLLM's ``AgentTrainer`` with ``backend="skyrl"``: the flow calls the policy over OpenAI's chat API
at rLLM's model gateway, which forwards to the run's inference servers and records the token ids
and logprobs they sampled; the trainer builds the steps from those. Needs rLLM installed;
``rllm/backend=skyrl`` on the command line registers the backend (the Hydra plug-in).

    examples/simple_math/train_agentflow.sh [overrides]
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig
from rllm.trainer import AgentTrainer

from examples.simple_math.flow import digit_evaluator, digit_flow
from examples.simple_math.train_with_rllm import digit_datasets


@hydra.main(config_path="pkg://rllm.trainer.config", config_name="unified", version_base=None)
def main(config: DictConfig) -> None:
    train, val = digit_datasets()
    trainer = AgentTrainer(
        config=config,
        agent_flow=digit_flow,
        evaluator=digit_evaluator,
        train_dataset=train,
        val_dataset=val,
        backend="skyrl",
    )
    trainer.train()


if __name__ == "__main__":
    main()
