"""rLLM's SFT metric names beside SkyRL's, and the run's ``metrics.jsonl``.

SkyRL's trainer logs ``train/loss``, ``eval/<name>/loss``, ``train/epoch``...; rLLM's SFT backends log
``train_mean_nll``, ``test/mean_nll``, ``epoch``, ``progress``, ``learning_rate``, ``num_sequences``,
``num_tokens``, ``num_loss_tokens`` and ``time/total`` (tinker's loop). A SkyRL callback adds rLLM's
names to the dict SkyRL's tracker is about to log (so wandb shows both) and appends it to
``metrics.jsonl`` in the run directory, as every run of this package does.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skyrl.train.utils.callbacks import TrainingCallback

from rllm_skyrl.run.metrics_file import MetricsFile


def learning_rate_schedule(optimizer_config: Any, total_steps: int) -> Callable[[int], float]:
    """The rate SkyRL's workers step with at (1-based) step ``k``: transformers' scheduler, which the
    workers build from the same settings, evaluated on a one-parameter optimizer."""
    import torch
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optimizer_config.lr)
    factor = get_scheduler(
        optimizer_config.scheduler,
        optimizer,
        num_warmup_steps=optimizer_config.num_warmup_steps,
        num_training_steps=total_steps,
    ).lr_lambdas[0]
    return lambda step: optimizer_config.lr * factor(step - 1)


class RLLMMetrics(TrainingCallback):
    """Adds rLLM's names on ``on_log`` and appends each record to ``<run_dir>/metrics.jsonl``."""

    def __init__(self, run_dir: str | Path, learning_rate: Callable[[int], float]) -> None:
        self.file = MetricsFile(run_dir)
        self.learning_rate = learning_rate
        self._batch: dict[str, int] = {}

    def on_train_start(self, trainer, callback_input, control) -> None:
        # A resumed run rewrites the records after its checkpoint (one history per directory).
        self.file.keep_through(callback_input.global_step or -1)

    def on_step_start(self, trainer, callback_input, control) -> None:
        batch = callback_input.batch
        pad_rows = (batch.metadata or {}).get("pad_size", 0)
        loss_mask = batch["loss_mask"]
        self._batch = {
            "num_sequences": int(loss_mask.shape[0] - pad_rows),
            "num_loss_tokens": int((loss_mask > 0).sum().item()),
        }

    def on_log(self, trainer, callback_input, control) -> None:
        logs = callback_input.logs
        step = callback_input.global_step
        eval_losses = [
            value for key, value in logs.items() if key.startswith("eval/") and key.endswith("/loss")
        ]
        if eval_losses:
            logs["test/mean_nll"] = statistics.fmean(eval_losses)
        if "train/loss" in logs:
            total = max(callback_input.total_steps, 1)
            logs.update(
                train_mean_nll=logs["train/loss"],
                epoch=logs["train/epoch"],
                progress=min(step / total, 1.0),
                learning_rate=self.learning_rate(step),
                num_tokens=logs["train/actual_num_tokens"],
                **{"time/total": logs["timing/step"]},
                **self._batch,
            )
        self.file.append(step, logs)
