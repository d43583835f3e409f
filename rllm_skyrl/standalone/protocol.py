"""What a training backend implements for the driver (rLLM's ``BackendProtocol``).

Method names, argument names and sync/async-ness match ``rllm/trainer/backend_protocol.py``,
so one backend class serves both rLLM's ``UnifiedTrainer`` and ours. In particular the workflow
engine argument of ``generate_episodes`` is called ``agent_workflow_engine`` and is passed by
keyword, as rLLM does. The backend owns no loop: the driver calls, in order (on-policy mode)::

    validate_config -> init_rollout_engine -> on_train_start -> [on_validation_start ... end]
    -> on_epoch_start -> per batch: on_batch_start, generate_episodes, transform_to_backend_batch,
       process_backend_batch, compute_advantages, update_policy, on_batch_end (always)
    -> on_epoch_end -> on_train_end -> shutdown

``on_policy_updated`` belongs to rLLM's fully-async mode and is not called here, so weight sync
and checkpointing go in ``on_batch_end``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

if TYPE_CHECKING:
    from rllm_skyrl.records import Episode
    from rllm_skyrl.standalone.config import AlgorithmConfig
    from rllm_skyrl.standalone.rollout_engine import RolloutEngine
    from rllm_skyrl.standalone.state import TrainerState
    from rllm_skyrl.standalone.workflow import WorkflowEngine


class BackendProtocol[TDataset: Iterable, TBatch](ABC):
    """A training backend. ``config`` is the FULL run config (native keys plus ``rllm.*``).

    After ``init_rollout_engine`` the backend exposes ``rollout_engine`` and ``tokenizer``
    (plain attributes, as in rLLM's backends).
    """

    name: str = "base_backend"
    requires_loop: bool = False
    rollout_engine: RolloutEngine | None = None
    tokenizer: Any = None

    def __init__(self, config: DictConfig, **kwargs: Any) -> None:
        self.config = config

    @abstractmethod
    def validate_config(self) -> None:
        """Reject bad settings before anything (servers, workers, loggers) has started."""

    @abstractmethod
    def init_rollout_engine(self, **kwargs: Any) -> RolloutEngine:
        """Start inference and return the engine workflows sample from.

        The driver passes ``cf_config``, ``transform_config``, ``rs_config``,
        ``algorithm_config`` and ``total_training_steps`` as keywords.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Release everything; synchronous because it may run with no event loop left."""

    @abstractmethod
    async def generate_episodes(
        self,
        batch: Any,
        agent_workflow_engine: WorkflowEngine,
        is_validation: bool = False,
        **kwargs: Any,
    ) -> list[Episode]:
        """Roll out a batch of tasks: repeat each task ``rllm.rollout.n`` (``n_val``) times with a
        shared task id, then ``await agent_workflow_engine.execute_tasks(tasks, task_ids,
        is_validation=is_validation)``."""

    @abstractmethod
    def transform_to_backend_batch(self, trainer_state: TrainerState, **kwargs: Any) -> TBatch:
        """Turn ``trainer_state.trajectory_groups`` into the backend's training batch."""

    @abstractmethod
    async def process_backend_batch(self, trainer_state: TrainerState, **kwargs: Any) -> None:
        """Forward/backward work on ``trainer_state.backend_batch``; must leave it non-None."""

    @abstractmethod
    async def compute_advantages(
        self, trainer_state: TrainerState, algorithm_config: AlgorithmConfig, **kwargs: Any
    ) -> None:
        """Publish advantage metrics. Runs after ``process_backend_batch`` (rLLM's order), so a
        backend whose loss needs advantages computes them earlier and only reports here."""

    @abstractmethod
    async def update_policy(self, trainer_state: TrainerState, **kwargs: Any) -> None:
        """Apply the optimizer step."""

    # Hooks: optional, no-ops unless a backend overrides them.

    async def on_train_start(self, trainer_state: TrainerState) -> None:  # noqa: B027 (optional hook)
        """Resume point: set ``trainer_state.global_step`` and reload the dataloader state."""

    async def on_train_end(self, trainer_state: TrainerState) -> None:  # noqa: B027 (optional hook)
        """Final checkpoint; runs even when training raised."""

    async def on_epoch_start(self, trainer_state: TrainerState) -> None:  # noqa: B027 (optional hook)
        """Called before the first batch of each epoch."""

    async def on_epoch_end(self, trainer_state: TrainerState) -> None:  # noqa: B027 (optional hook)
        """Called after the last batch of each epoch."""

    async def on_batch_start(self, trainer_state: TrainerState) -> None:  # noqa: B027 (optional hook)
        """Called before episodes are generated for a batch."""

    async def on_batch_end(self, trainer_state: TrainerState) -> None:  # noqa: B027 (optional hook)
        """Weight sync, checkpoint, backend metrics; runs even when the step raised or stopped early."""

    async def on_policy_updated(self, trainer_state: TrainerState) -> None:  # noqa: B027 (optional hook)
        """Weight sync hook of rLLM's fully-async mode (never called by this on-policy driver)."""

    async def on_validation_start(self, trainer_state: TrainerState) -> bool:
        """Return False to skip this validation round."""
        trainer_state.is_training = False
        return True

    async def on_validation_end(self, trainer_state: TrainerState) -> None:
        trainer_state.is_training = True
