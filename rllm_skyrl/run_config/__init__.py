"""The one config layer: a composed Hydra config in, one resolved ``RunConfig`` out.

bridge       rLLM keys <-> SkyRL keys, one table, one precedence rule
skyrl        SkyRL's typed config from dotted keys, errors naming the whole key
resolve      ``resolve_run_config``, section by section; ``settings`` the ``RunConfig`` it returns
algorithm    estimators, losses, loss reduction, old logprobs (the ``rllm.algorithm`` section)
lora         tinker's LoRA keys -> SkyRL's trainer.policy.model.lora (target modules from the model)
model_paths  model names -> directories this machine can load
tree         dotted lookups on a composed config
"""

from rllm_skyrl.run_config.bridge import BRIDGE, skyrl_overrides
from rllm_skyrl.run_config.lora import LoraSettings
from rllm_skyrl.run_config.model_paths import BUILTIN_MODELS, resolve_model_path
from rllm_skyrl.run_config.resolve import RESUME_MODES, resolve_run_config, roles_for
from rllm_skyrl.run_config.settings import (
    CheckpointSettings,
    ConfigError,
    InferenceSettings,
    RunConfig,
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
