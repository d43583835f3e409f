"""GRPO on the addition task with the digit example's settings: ``python -m examples.sft.rl_addition``.

Start it from an SFT export with ``model.path=<sft.export_dir> training.learning_rate=3e-4`` (the digit
example's 1e-3 is tuned for learning from scratch and erodes memorised answers); with the default
``model.path=tiny`` it is the from-scratch baseline.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from examples.sft.task import make_rows, reward_fn
from rllm_skyrl.launcher import run


@hydra.main(config_path="../simple_math", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    run(
        cfg,
        workflow_class="rllm_skyrl.standalone.workflow.SingleTurnWorkflow",
        workflow_args={"reward_fn": reward_fn},
        train_dataset=make_rows(cfg.dataset.train_rows, seed=cfg.dataset.seed),
        val_dataset=make_rows(cfg.dataset.val_rows, seed=cfg.dataset.seed + 1),
    )


if __name__ == "__main__":
    main()
