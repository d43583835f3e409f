"""GRPO on the digit task through SkyRLBackend: ``python examples/simple_math/train.py [overrides]``."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from examples.simple_math.task import make_rows, reward_fn
from rllm_skyrl.launcher import run


@hydra.main(config_path=".", config_name="config", version_base=None)
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
