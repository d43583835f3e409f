"""One RL update over a batch: forward_backward per mini-batch (and PPO epoch), optimizer steps between.

The last optimizer step of a batch is left to the caller (``update_policy``), so gradients of
several calls accumulate when rLLM's fully-async mode hands one step's groups in chunks.

Trajectory roles may train with different policy losses (rLLM's per-role ``loss_fn_map``): a
mini-batch is then forward-backwarded once per role on that role's rows. SkyRL's policy losses are
masked sums over advantages already scaled for the whole mini-batch's reduction, so the roles'
shares (``train/policy_loss/<role>/<loss_fn>``) add up to the unsplit loss and their gradients to
exactly the unsplit gradient.
"""

from __future__ import annotations

import math
from typing import Any

from rllm_skyrl.data.batch_layout import real_rows, row_slice, select_rows
from rllm_skyrl.run.metrics import StepMetrics, logprob_gap_metrics, worker_metrics
from rllm_skyrl.run_config.losses import is_decoupled
from rllm_skyrl.update import off_policy


class PolicyUpdate:
    """Trains the run's roles on one batch through ``models`` (a ``ModelRegistry``), in which it
    creates one model per trained role, named after the role."""

    def __init__(self, run: Any, models: Any, dp_size: int, metrics: StepMetrics) -> None:
        self.run = run
        self.models = models
        self.dp_size = dp_size
        self.metrics = metrics
        # Losses decoupled for bypass mode (``off_policy``) are registered once the workers exist.
        names = {loss.skyrl_loss_name for loss in (run.policy_loss, *run.role_losses.values())}
        if any(is_decoupled(name) for name in names):
            off_policy.register(names)
        for role in run.trained_roles:
            models.create_model(role, model_role=role)

    def boundaries(self, batch: Any) -> list[tuple[int, int]]:
        """Contiguous row ranges, one per optimizer step; each a multiple of the DP size but the last."""
        num_rows = real_rows(batch)
        count = min(self.run.num_minibatches, max(num_rows // self.dp_size, 1))
        size = math.ceil(num_rows / count / self.dp_size) * self.dp_size
        return [(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]

    def accumulate(self, batch: Any, boundaries: list[tuple[int, int]]) -> None:
        """forward_backward over every mini-batch and epoch; an optimizer step between consecutive ones."""
        plan = boundaries * self.run.update_epochs
        for index, (start, end) in enumerate(plan):
            for role in self.run.trained_roles:
                with self.metrics.timed(
                    "forward_backward" if role == "policy" else f"forward_backward_{role}"
                ):
                    if role == "policy":
                        self._policy(batch, start, end, first=index == 0)
                    else:
                        minibatch = row_slice(batch, start, end, self.dp_size)
                        output = self.models.forward_backward(role, minibatch, self.run.critic_loss)
                        self.metrics.add(worker_metrics(role, output.metrics))
            if index < len(plan) - 1:
                self.optim_step()

    def _policy(self, batch: Any, start: int, end: int, first: bool) -> None:
        roles = [uid.rpartition(":")[2] for uid in batch.metadata["uids"][start:end]]  # "task:role"
        losses = {role: self.run.loss_for(role) for role in dict.fromkeys(roles)}
        if all(loss == losses[roles[0]] for loss in losses.values()):
            parts = [(None, losses[roles[0]], row_slice(batch, start, end, self.dp_size))]
        else:
            parts = [
                (
                    role,
                    loss,
                    select_rows(batch, [start + i for i, r in enumerate(roles) if r == role], self.dp_size),
                )
                for role, loss in losses.items()
            ]
        for role, loss, part in parts:
            output = self.models.forward_backward("policy", part, loss, elementwise_loss=False)
            metrics = worker_metrics("policy", output.metrics)
            self.metrics.add(metrics)
            if role is not None:
                share = metrics.get("train/policy_loss", metrics.get("train/loss"))
                self.metrics.add({f"train/policy_loss/{role}/{loss.loss_fn}": share})
            if first:  # the sampler-vs-trainer gap is measured before any update of this batch
                logprobs = [{"logprobs": row["logprobs"]["data"]} for row in output.loss_fn_outputs]
                self.metrics.add(logprob_gap_metrics(part, logprobs))

    def optim_step(self) -> None:
        """Apply the accumulated gradients of every trained role."""
        with self.metrics.timed("optim_step"):
            for role in self.run.trained_roles:
                grad_norm = self.models.optim_step(role)
                if grad_norm is not None:
                    self.metrics.add({f"{'train' if role == 'policy' else role}/grad_norm": float(grad_norm)})
