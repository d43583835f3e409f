"""GRPO on the successor task under rLLM's ``AgentTrainer(backend="skyrl")``, from a model directory.

``python -m examples.sft.rl model.path=<SFT model dir> [overrides]``: the digit example's config and
workflow with the successor task's rows. From the SFT export most answers are right at the first
step; from ``model.path=tiny`` (random init) almost none are.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from examples.sft.task import digit_reward, make_rows


@hydra.main(config_path="../simple_math", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from rllm.data import Dataset
    from rllm.trainer import AgentTrainer

    from examples.simple_math.workflow import AskOnceWorkflow
    from rllm_skyrl.rllm_plugin import register

    register()
    AgentTrainer(
        config=cfg,
        workflow_class=AskOnceWorkflow,
        workflow_args={"reward_function": digit_reward},
        train_dataset=Dataset(make_rows(cfg.dataset.train_rows, seed=cfg.dataset.seed)),
        val_dataset=Dataset(make_rows(cfg.dataset.val_rows, seed=cfg.dataset.seed + 1)),
        backend="skyrl",
    ).train()


if __name__ == "__main__":
    main()
