"""The one config layer: a composed Hydra config in, one resolved ``RunConfig`` out.

Which value wins depends only on the composed config's content, never on whether a key came from
the command line, a yaml file or a dict, and resolving never changes the config it is given:

1. A set (non-null) key of rLLM's tinker or verl backend (``aliases.KEYS``) is the value of the
   key it aliases, whatever that key holds: rLLM's base config gives most of them defaults, so
   their holding a value says nothing about the user. Two aliases of one key that disagree are an
   error naming both.
2. rLLM's keys (``rllm.*``) and the backend's own (``model.*``, ``training.*``, ``inference.*``)
   are the source; their SkyRL counterparts under ``skyrl.*`` (``bridge.BRIDGE``) follow them. The
   shipped yaml sets none of those counterparts, so a set one was set by the user: if its source
   is set too and says otherwise (after translation: ``rllm.algorithm.lr_schedule=constant`` is
   SkyRL's ``constant_with_warmup``), that is an error naming both keys and their values and asking
   for the source; if its source is null, it is used.
3. SkyRL keys derived from several settings (mini-batch sizes, the critic's and the reference's
   model, LoRA target modules, ``reshard_after_forward``) are filled in only where left unset, and
   what the machine requires (sdpa without flash-attn, no colocation on CPU) always applies
   (``hardware.Platform.skyrl_overrides``).
"""

from rllm_skyrl.run_config.aliases import trainer_keys_behind, with_aliases
from rllm_skyrl.run_config.bridge import BRIDGE, skyrl_overrides
from rllm_skyrl.run_config.lora import LoraSettings
from rllm_skyrl.run_config.resolve import check_settings, resolve_run_config, roles_for
from rllm_skyrl.run_config.settings import (
    CheckpointSettings,
    ConfigError,
    InferenceSettings,
    RunConfig,
)
from rllm_skyrl.run_config.skyrl import make_skyrl_config

__all__ = [
    "BRIDGE",
    "check_settings",
    "CheckpointSettings",
    "ConfigError",
    "InferenceSettings",
    "LoraSettings",
    "RunConfig",
    "make_skyrl_config",
    "resolve_run_config",
    "roles_for",
    "skyrl_overrides",
    "trainer_keys_behind",
    "with_aliases",
]
