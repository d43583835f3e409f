"""An rLLM ``SFTSpec`` as SkyRL's ``SFTConfig`` (the backend's native config), and SkyRL's training
config for it with the platform's settings.

The native config holds ``SFTConfig`` fields only, plus an ``rllm`` section for what SkyRL has no
field for (``tokenize_method``); ``spec.overrides`` merges into it, so any ``SFTConfig`` field can be
set (``{"optimizer_config": {"weight_decay": 0.0}}``). Spec fields map one to one: ``lr_schedule`` is a
transformers scheduler name as SkyRL's is, ``lora_rank`` 0 trains every weight, ``save_freq`` and
``val_freq`` <= 0 turn periodic saving and validation off (SkyRL still saves and validates once at
the end), and a run resumes from the latest checkpoint in its directory, as rLLM's tinker backend does.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf
from rllm.trainer.sft.backend import SFTConfigError
from rllm.trainer.sft.spec import LR_SCHEDULES, TOKENIZE_METHODS

from rllm_skyrl.hardware import Platform
from rllm_skyrl.run_config.model_paths import check_model_path, resolve_model_path

RLLM_SECTION = "rllm"


def check_spec(spec: Any) -> None:
    """The spec's scalar fields, each refused with what to set instead."""
    check_model_path("model", spec.model)
    if spec.tokenize_method not in TOKENIZE_METHODS:
        raise SFTConfigError(
            f"tokenize_method={spec.tokenize_method!r}: use one of {', '.join(TOKENIZE_METHODS)}"
        )
    if spec.lr_schedule not in LR_SCHEDULES:
        raise SFTConfigError(f"lr_schedule={spec.lr_schedule!r}: use one of {', '.join(LR_SCHEDULES)}")
    for name in ("batch_size", "epochs", "max_length"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SFTConfigError(f"{name}={value!r}: must be an integer >= 1")
    if isinstance(spec.lora_rank, bool) or not isinstance(spec.lora_rank, int) or spec.lora_rank < 0:
        raise SFTConfigError(f"lora_rank={spec.lora_rank!r}: must be an integer >= 0 (0 = full fine-tuning)")
    if not spec.lr > 0:
        raise SFTConfigError(f"lr={spec.lr!r}: must be > 0")


def gpus_per_node(platform: Platform) -> int:
    """Data-parallel ranks: every visible GPU; one CPU worker (it uses every core)."""
    if not platform.cuda:
        return 1
    import torch

    return torch.cuda.device_count()


def native_config(spec: Any, output_dir: str, platform: Platform) -> DictConfig:
    """``SFTConfig`` fields for ``spec`` (data paths and step counts come with the data)."""
    gpus = gpus_per_node(platform)
    if spec.batch_size % gpus:
        raise SFTConfigError(
            f"batch_size={spec.batch_size}: must be a multiple of the {gpus} GPUs it is split over"
        )
    rank = int(spec.lora_rank)
    fields: dict[str, Any] = {
        "strategy": "fsdp",
        "model": {"path": resolve_model_path(spec.model), "lora": {"rank": rank, "alpha": 2 * rank or 16}},
        "optimizer_config": {"lr": float(spec.lr), "scheduler": spec.lr_schedule, "num_warmup_steps": 0},
        "placement": {"num_nodes": 1, "num_gpus_per_node": gpus},
        "batch_size": spec.batch_size,
        "micro_train_batch_size_per_gpu": spec.batch_size // gpus,
        "max_length": spec.max_length,
        "num_epochs": spec.epochs,
        "project_name": spec.project,
        "run_name": spec.experiment or "default",
        "ckpt_path": output_dir,
        "ckpt_interval": max(int(spec.save_freq), 0),
        "resume_from": "latest",
        "export_path": os.path.join(output_dir, "hf_exports"),
        "eval_interval": max(int(spec.val_freq), 0),
        "num_workers": 0,  # the rows arrive tokenized
        "enable_ray_gpu_monitor": platform.cuda,
        "remove_microbatch_padding": platform.flash_attn,
        "fsdp_config": {"reshard_after_forward": platform.reshard_after_forward},
        RLLM_SECTION: {"tokenize_method": spec.tokenize_method},
    }
    cfg = OmegaConf.create(fields)
    if spec.overrides:
        cfg = OmegaConf.merge(cfg, OmegaConf.create(spec.overrides))
    return cfg


def sft_config(cfg: DictConfig):
    """SkyRL's typed ``SFTConfig`` from the native config (unknown keys are SkyRL's errors)."""
    from skyrl.train.config.sft_config import SFTConfig

    fields = OmegaConf.to_container(cfg, resolve=True)
    fields.pop(RLLM_SECTION, None)
    try:
        return SFTConfig.from_dict_config(OmegaConf.create(fields))
    except (TypeError, ValueError) as error:
        raise SFTConfigError(f"SkyRL SFT config: {error}") from error


def training_config(sft_cfg: Any, platform: Platform):
    """SkyRL's bridge from ``SFTConfig`` to its workers' config, then the platform's forced values."""
    from skyrl.train.config.sft_config import build_skyrl_config_for_sft

    skyrl_cfg = build_skyrl_config_for_sft(sft_cfg)
    for key, value in platform.skyrl_overrides().items():
        _set(skyrl_cfg, key, value)
    return skyrl_cfg


def _set(config: Any, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = getattr(node, part)
    if not dataclasses.is_dataclass(node) or leaf not in {f.name for f in dataclasses.fields(node)}:
        raise AttributeError(f"SkyRL's config has no {dotted!r}")
    setattr(node, leaf, value)
