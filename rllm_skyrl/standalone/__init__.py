"""The trainer used when rLLM is not installed: driver, backend protocol, workflows, loader, tracking.

Names and call order match rLLM's unified trainer, so the same backend and workflow code runs
under either; a test records both call sequences and compares them.
"""

from rllm_skyrl.records import (
    Episode,
    ModelOutput,
    Step,
    TerminationReason,
    Trajectory,
    TrajectoryGroup,
)
from rllm_skyrl.standalone.config import (
    AlgorithmConfig,
    CompactFilteringConfig,
    RejectionSamplingConfig,
    RolloutCorrectionConfig,
    TransformConfig,
)
from rllm_skyrl.standalone.dataloader import StatefulTaskDataLoader, load_rows
from rllm_skyrl.standalone.driver import UnifiedTrainer
from rllm_skyrl.standalone.protocol import BackendProtocol
from rllm_skyrl.standalone.rollout_engine import RolloutEngine
from rllm_skyrl.standalone.state import TrainerState
from rllm_skyrl.standalone.tracking import Tracking, plot_run, redact
from rllm_skyrl.standalone.workflow import (
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
