"""GRPO on the digit task: ``python -m examples.simple_math.train [overrides]``.

Under rLLM's ``UnifiedTrainer`` with the SkyRL backend, on rLLM's base config, with a workflow
written against rLLM's ``Workflow`` (``workflow.py``); without rLLM installed, on the standalone
fallback (``rllm_skyrl.rllm_names``).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from examples.simple_math.task import digit_reward, make_rows
from rllm_skyrl.training_run import train


@hydra.main(config_path=".", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    train(
        cfg,
        workflow_class="examples.simple_math.workflow.AskOnceWorkflow",  # imported after Ray starts
        workflow_args={"reward_function": digit_reward},
        train_dataset=make_rows(cfg.dataset.train_rows, seed=cfg.dataset.seed),
        val_dataset=make_rows(cfg.dataset.val_rows, seed=cfg.dataset.seed + 1),
    )


if __name__ == "__main__":
    main()
