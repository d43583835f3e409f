"""The state the standalone trainer and the backend hooks share (rLLM's ``TrainerState``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rllm_skyrl.records import Episode, TrajectoryGroup

if TYPE_CHECKING:
    from rllm_skyrl.standalone.dataloader import StatefulTaskDataLoader


@dataclass
class TrainerState:
    """What the driver and the backend hooks share; the per-batch part is cleared by ``reset_batch``."""

    global_step: int = 0
    epoch: int = 0
    total_steps: int = 0
    is_training: bool = True
    weight_version: int = 0
    train_dataloader: StatefulTaskDataLoader | None = None
    timing_dict: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)
    episodes: list[Episode] | None = None
    trajectory_groups: list[TrajectoryGroup] | None = None
    backend_batch: Any = None

    def reset_batch(self) -> None:
        self.episodes = None
        self.trajectory_groups = None
        self.backend_batch = None
        self.timing_dict = {}
        self.metrics = {}
        self.extra_info = {}

    @property
    def has_episodes(self) -> bool:
        return bool(self.episodes)

    @property
    def has_trajectory_groups(self) -> bool:
        return bool(self.trajectory_groups)

    @property
    def has_backend_batch(self) -> bool:
        return self.backend_batch is not None
