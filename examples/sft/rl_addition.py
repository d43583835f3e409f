"""GRPO on the addition task with the digit example's settings: ``python -m examples.sft.rl_addition``.

Start it from an SFT export with ``model.path=<sft.export_dir> training.learning_rate=3e-4`` (the digit
example's 1e-3 is tuned for learning from scratch and erodes memorised answers); with the default
``model.path=tiny`` it is the from-scratch baseline.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from examples.sft.task import digit_reward, make_rows
from rllm_skyrl.training_run import train


@hydra.main(config_path="../simple_math", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    train(
        cfg,
        workflow_class="examples.simple_math.workflow.AskOnceWorkflow",
        workflow_args={"reward_function": digit_reward},
        train_dataset=make_rows(cfg.dataset.train_rows, seed=cfg.dataset.seed),
        val_dataset=make_rows(cfg.dataset.val_rows, seed=cfg.dataset.seed + 1),
    )


if __name__ == "__main__":
    main()
