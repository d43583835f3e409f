"""Solver-judge GRPO through SkyRLBackend: ``python -m examples.solver_judge.train [overrides]``.

Under rLLM's ``UnifiedTrainer`` when rLLM is installed, the standalone fallback otherwise.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from examples.simple_math.task import make_rows
from rllm_skyrl.training_run import train


@hydra.main(config_path=".", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    train(
        cfg,
        workflow_class="examples.solver_judge.workflow.SolverJudgeWorkflow",  # imported after Ray starts
        workflow_args={"num_solutions": cfg.workflow.num_solutions},
        train_dataset=make_rows(cfg.dataset.train_rows, seed=cfg.dataset.seed),
        val_dataset=make_rows(cfg.dataset.val_rows, seed=cfg.dataset.seed + 1),
    )


if __name__ == "__main__":
    main()
