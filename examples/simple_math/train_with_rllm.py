"""GRPO on the digit task under rLLM's own trainer, as an rLLM user writes it.

rLLM's packaged config (``pkg://rllm.trainer.config``, ``unified``), rLLM's ``SimpleWorkflow``, rLLM's
``DatasetRegistry`` and ``AgentTrainer``; the SkyRL backend is picked on the command line with
``rllm/backend=skyrl`` (see ``train_with_rllm.sh``). Needs rLLM installed (it is not on PyPI).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig
from rllm.data.dataset import DatasetRegistry
from rllm.trainer import AgentTrainer
from rllm.workflows.simple_workflow import SimpleWorkflow

from examples.simple_math.task import DATA_SOURCE, digit_reward, make_rows


def digit_datasets(train_rows: int = 4096, val_rows: int = 50, seed: int = 0):
    """Register the digit rows with rLLM's dataset registry (parquet under $RLLM_HOME) and load them."""
    DatasetRegistry.register_dataset(DATA_SOURCE, make_rows(train_rows, seed=seed), "train")
    DatasetRegistry.register_dataset(DATA_SOURCE, make_rows(val_rows, seed=seed + 1), "test")
    train = DatasetRegistry.load_dataset(DATA_SOURCE, "train")
    return train, DatasetRegistry.load_dataset(DATA_SOURCE, "test")


@hydra.main(config_path="pkg://rllm.trainer.config", config_name="unified", version_base=None)
def main(config: DictConfig) -> None:
    train, val = digit_datasets()
    trainer = AgentTrainer(
        config=config,
        workflow_class=SimpleWorkflow,
        workflow_args={"reward_function": digit_reward},
        train_dataset=train,
        val_dataset=val,
        backend=config.rllm.get("backend", "skyrl"),
    )
    trainer.train()


if __name__ == "__main__":
    main()
