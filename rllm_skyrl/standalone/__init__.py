"""The trainer used when rLLM is not installed: rLLM's call order and names, on-policy only.

Training code names its trainer, workflows and records through ``rllm_skyrl.rllm_names``, which
hands out rLLM's classes when rLLM is installed and these otherwise; a test records the backend's
hook calls under both trainers and compares them.
"""

from rllm_skyrl.standalone.dataloader import StatefulTaskDataLoader
from rllm_skyrl.standalone.driver import UnifiedTrainer
from rllm_skyrl.standalone.workflow import SimpleWorkflow, Workflow, WorkflowEngine

__all__ = ["SimpleWorkflow", "StatefulTaskDataLoader", "UnifiedTrainer", "Workflow", "WorkflowEngine"]
