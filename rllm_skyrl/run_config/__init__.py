"""The one config layer: a composed Hydra config in, one resolved ``RunConfig`` out.

bridge   rLLM keys <-> SkyRL keys, one table, one precedence rule
skyrl    SkyRL's typed config from dotted keys, errors naming the whole key
resolve  the checked, immutable ``RunConfig`` everything downstream reads
lora     tinker's LoRA keys -> SkyRL's trainer.policy.model.lora (target modules from the model)
tree     dotted lookups on a composed config
"""

from rllm_skyrl.run_config.bridge import BRIDGE, skyrl_overrides
from rllm_skyrl.run_config.lora import LoraSettings
from rllm_skyrl.run_config.resolve import (
    BUILTIN_MODELS,
    RESUME_MODES,
    CheckpointSettings,
    ConfigError,
    InferenceSettings,
    RunConfig,
    resolve_model_path,
    resolve_run_config,
    roles_for,
)
from rllm_skyrl.run_config.skyrl import make_skyrl_config
from rllm_skyrl.run_config.tree import select

__all__ = [
    "BRIDGE",
    "BUILTIN_MODELS",
    "RESUME_MODES",
    "CheckpointSettings",
    "ConfigError",
    "InferenceSettings",
    "LoraSettings",
    "RunConfig",
    "make_skyrl_config",
    "resolve_model_path",
    "resolve_run_config",
    "roles_for",
    "select",
    "skyrl_overrides",
]
