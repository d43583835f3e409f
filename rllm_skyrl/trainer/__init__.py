"""A small rLLM-compatible training driver: types, backend protocol, workflows, loader, tracking.

Used when rLLM is not installed; names and call order match rLLM's unified trainer so the same
backend and workflow code runs under either.
"""

from rllm_skyrl.trainer.config import (
    AlgorithmConfig,
    CompactFilteringConfig,
    RejectionSamplingConfig,
    RolloutCorrectionConfig,
    TransformConfig,
)
from rllm_skyrl.trainer.dataloader import StatefulTaskDataLoader, load_rows
from rllm_skyrl.trainer.driver import UnifiedTrainer
from rllm_skyrl.trainer.protocol import BackendProtocol
from rllm_skyrl.trainer.rollout_engine import RolloutEngine
from rllm_skyrl.trainer.tracking import Tracking, plot_run, redact
from rllm_skyrl.trainer.types import (
    Episode,
    ModelOutput,
    Step,
    TerminationReason,
    TrainerState,
    Trajectory,
    TrajectoryGroup,
)
from rllm_skyrl.trainer.workflow import (
    MultiTurnWorkflow,
    SingleTurnWorkflow,
    Workflow,
    WorkflowEngine,
    repeat_tasks,
    task_messages,
)

__all__ = [
    "AlgorithmConfig",
    "BackendProtocol",
    "CompactFilteringConfig",
    "Episode",
    "ModelOutput",
    "MultiTurnWorkflow",
    "RejectionSamplingConfig",
    "RolloutCorrectionConfig",
    "RolloutEngine",
    "SingleTurnWorkflow",
    "StatefulTaskDataLoader",
    "Step",
    "TerminationReason",
    "Tracking",
    "TrainerState",
    "Trajectory",
    "TrajectoryGroup",
    "TransformConfig",
    "UnifiedTrainer",
    "Workflow",
    "WorkflowEngine",
    "load_rows",
    "plot_run",
    "redact",
    "repeat_tasks",
    "task_messages",
]
