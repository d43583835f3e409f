"""The composed Hydra config -> one checked, immutable ``RunConfig``, section by section."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from rllm_skyrl.hardware import Platform, cpu_threads
from rllm_skyrl.run_config import bridge
from rllm_skyrl.run_config.algorithm import resolve_algorithm, with_off_policy_correction
from rllm_skyrl.run_config.aliases import with_aliases
from rllm_skyrl.run_config.lora import LoraSettings, resolve_lora
from rllm_skyrl.run_config.model_paths import check_model_path, resolve_model_path
from rllm_skyrl.run_config.settings import (
    CheckpointSettings,
    ConfigError,
    InferenceSettings,
    RolloutSettings,
    RunConfig,
)
from rllm_skyrl.run_config.skyrl import make_skyrl_config
from rllm_skyrl.run_config.tree import select
from rllm_skyrl.run_config.values import check_values

_POLICY_PATH = "trainer.policy.model.path"


def resolve_run_config(
    cfg: DictConfig, *, platform: Platform | None = None, resolve_models: bool = True
) -> RunConfig:
    """Everything a run needs, checked before anything starts; ``ConfigError`` names the key to change.
    ``resolve_models=False`` keeps model names as given (``rllm-skyrl plan`` describes a cluster
    whose model may not be on this machine)."""
    platform = platform or Platform.detect()
    cfg, algorithm = _checked_settings(cfg)
    overrides, model_path, lora = _skyrl_keys(cfg, platform, resolve_models)
    skyrl_cfg = _skyrl_config(overrides, platform)
    async_training, async_chunks = _async_training(cfg, skyrl_cfg)
    with _config_errors():
        algorithm = with_off_policy_correction(algorithm, cfg, skyrl_cfg)
    roles = roles_for(skyrl_cfg)
    # On-policy, rollouts and the trainer take turns on the cores; fully-async they overlap.
    overlap = 2 if async_training else 1
    return RunConfig(
        platform=platform,
        skyrl=skyrl_cfg,
        model_path=model_path,
        roles=roles,
        **algorithm,
        **_sampling(cfg, skyrl_cfg),
        drop_malformed=bool(select(cfg, "training.drop_malformed", False)),
        inference=_inference(cfg, overlap),
        checkpoint=_checkpoint(cfg, skyrl_cfg),
        rollout=_rendering(cfg),
        lora=lora,
        async_training=async_training,
        async_chunks=async_chunks,
        cpu_threads=int(
            select(cfg, "training.cpu_threads") or cpu_threads(overlap * _workers_per_node(skyrl_cfg, roles))
        ),
        warmup_steps_ratio=float(select(cfg, "rllm.algorithm.warmup_steps_ratio", 0.0) or 0.0),
    )


def check_settings(cfg: DictConfig) -> None:
    """The checks that need neither SkyRL nor a model: a run makes them before it starts anything
    (its Ray included), so a wrong value costs no start-up. ``resolve_run_config`` makes them again."""
    cfg, _ = _checked_settings(cfg)
    with _config_errors():
        _check_model_paths(cfg)


def _checked_settings(cfg: DictConfig) -> tuple[DictConfig, dict[str, Any]]:
    """The config with its aliases applied, its values checked, and its algorithm."""
    with _config_errors():
        cfg = with_aliases(cfg)
        check_values(cfg)
        return cfg, resolve_algorithm(cfg)


def _check_model_paths(cfg: DictConfig) -> None:
    """The trained models are directories here, hub ids or built-in names (the user's key named)."""
    for source, role in (("model.path", "policy"), ("model.critic_path", "critic")):
        skyrl_key = f"skyrl.trainer.{role}.model.path"
        key = source if select(cfg, source) is not None else skyrl_key
        check_model_path(key, select(cfg, key))


@contextmanager
def _config_errors() -> Iterator[None]:
    """The checks below raise ``ValueError`` with the whole message; the run sees ``ConfigError``."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _skyrl_keys(
    cfg: DictConfig, platform: Platform, resolve_models: bool
) -> tuple[dict[str, Any], str, LoraSettings]:
    """SkyRL's dotted keys (``bridge``) with model names resolved and LoRA placed; the policy's model."""
    with _config_errors():
        overrides = bridge.skyrl_overrides(cfg)
        if not overrides.get(_POLICY_PATH):
            raise ValueError(
                "model.path is not set; pass model.path=<HF model dir> (or model.name=..., tiny, smollm2)"
            )
        if resolve_models:
            _check_model_paths(cfg)
            for role in ("policy", "ref", "critic"):
                key = f"trainer.{role}.model.path"
                if overrides.get(key):
                    overrides[key] = resolve_model_path(overrides[key])
        model_path = overrides[_POLICY_PATH]
        lora = resolve_lora(cfg, overrides, model_path, inspect=resolve_models)
    _check_lora_sync_path(cfg, overrides, lora, platform)
    for role in ("policy", "critic"):  # the trained models; null in the yaml: the platform's choice
        key = f"trainer.{role}.fsdp_config.reshard_after_forward"
        if overrides.get(key) is None:
            overrides[key] = platform.reshard_after_forward
    return overrides, model_path, lora


def _check_lora_sync_path(
    cfg: DictConfig, overrides: dict[str, Any], lora: LoraSettings, platform: Platform
) -> None:
    """This package's CPU servers read files from the run's sync directory only (``sync_dir``)."""
    sync_dir = (Path(overrides.get("trainer.ckpt_path") or ".") / "sync").resolve()
    serves_here = platform.server_kind(select(cfg, "inference.urls")) == "cpu_transformers"
    if lora.enabled and serves_here and not Path(lora.sync_path).is_relative_to(sync_dir):
        raise ConfigError(
            f"skyrl.trainer.policy.model.lora.lora_sync_path={lora.sync_path!r}: this package's CPU "
            f"servers load adapters only from under the run's sync directory {sync_dir}; drop the key "
            "(the adapter then goes to sync/lora there)"
        )


def _skyrl_config(overrides: dict[str, Any], platform: Platform) -> Any:
    """SkyRL's typed config; what SkyRL's own validation refuses is the user's to fix."""
    try:
        return make_skyrl_config(overrides, platform)
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"invalid SkyRL settings (skyrl.* or the keys bridged to them): {error}") from error


def roles_for(skyrl_cfg: Any) -> tuple[str, ...]:
    trainer = skyrl_cfg.trainer
    roles = ["policy"]
    if trainer.critic.model.path:
        roles.append("critic")
    if trainer.algorithm.use_kl_loss or trainer.algorithm.use_kl_in_reward:
        roles.append("ref")
    return tuple(roles)


def _sampling(cfg: DictConfig, skyrl_cfg: Any) -> dict[str, Any]:
    sampled_at = select(cfg, "rllm.rollout.train.temperature", 1.0)
    scored_at = skyrl_cfg.trainer.algorithm.temperature
    if abs(scored_at - sampled_at) > 1e-9:
        raise ConfigError(
            f"skyrl.trainer.algorithm.temperature={scored_at} differs from "
            f"rllm.rollout.train.temperature={sampled_at}: the trainer would score tokens under "
            "another distribution than they were sampled from; set rllm.rollout.train.temperature only"
        )
    return {
        "rollout_n": int(select(cfg, "rllm.rollout.n", 1)),
        "rollout_n_val": int(select(cfg, "rllm.rollout.n_val", 1)),
        "max_prompt_length": int(select(cfg, "rllm.data.max_prompt_length")),
        "max_response_length": int(select(cfg, "rllm.data.max_response_length")),
        "train_sampling": _set_values(select(cfg, "rllm.rollout.train")),
        "val_sampling": _set_values(select(cfg, "rllm.rollout.val")),
    }


def _set_values(section: Mapping[str, Any] | None) -> dict[str, Any]:
    return {key: value for key, value in (section or {}).items() if value is not None}


def _rendering(cfg: DictConfig) -> RolloutSettings:
    return RolloutSettings(
        disable_thinking=bool(select(cfg, "rllm.disable_thinking", False)),
        render_with_parser=bool(select(cfg, "rollout_engine.bypass_render_with_parser", False)),
        reasoning_effort=select(cfg, "rollout_engine.reasoning_effort"),
    )


def _checkpoint(cfg: DictConfig, skyrl_cfg: Any) -> CheckpointSettings:
    """Where checkpoints go (SkyRL's ``ckpt_path``, which follows ``training.default_local_dir``)."""
    resume_mode = select(cfg, "training.resume_mode", "auto")  # one of RESUME_MODES (check_values)
    resume_from_path = select(cfg, "training.resume_from_path")
    if resume_mode == "resume_path" and not resume_from_path:
        raise ConfigError(
            "training.resume_mode=resume_path needs training.resume_from_path=<global_step_N dir>"
        )
    return CheckpointSettings(
        root=Path(skyrl_cfg.trainer.ckpt_path),
        save_freq=int(select(cfg, "rllm.trainer.save_freq", 0) or 0),
        resume_mode=resume_mode,
        resume_from_path=resume_from_path,
        max_to_keep=int(select(cfg, "training.max_ckpts_to_keep", -1)),
    )


def _async_training(cfg: DictConfig, skyrl_cfg: Any) -> tuple[bool, int]:
    """Whether rLLM's fully-async mode is on, and the forward-backward calls of one optimizer step."""
    if not select(cfg, "rllm.async_training.enable", False):
        return False, 1
    if skyrl_cfg.trainer.update_epochs_per_batch != 1 or select(cfg, "training.num_minibatches", 1) != 1:
        raise ConfigError(
            "rllm.async_training.enable=true: rLLM hands the backend one optimizer step's groups in chunks "
            "(rllm.async_training.fwd_bwd_group_size) and steps once; set training.num_minibatches=1 and "
            "training.update_epochs=1 (use rllm.async_training.mini_batch_size for the step size)"
        )
    mini_batch = int(select(cfg, "rllm.async_training.mini_batch_size", 1))
    chunk = int(select(cfg, "rllm.async_training.fwd_bwd_group_size") or mini_batch)
    if mini_batch % chunk:
        raise ConfigError(
            f"rllm.async_training.fwd_bwd_group_size={chunk} must divide "
            f"rllm.async_training.mini_batch_size={mini_batch}"
        )
    return True, mini_batch // chunk


def _inference(cfg: DictConfig, overlap: int) -> InferenceSettings:
    """The servers to start (or use); a CPU server's threads share the cores with its siblings (and
    with training when the two ``overlap``)."""
    num_engines = int(select(cfg, "inference.num_engines", 1))
    return InferenceSettings(
        urls=tuple(select(cfg, "inference.urls") or ()),
        num_engines=num_engines,
        max_model_len=select(cfg, "inference.max_model_len"),
        max_batch_size=int(select(cfg, "inference.max_batch_size", 256)),
        deterministic_sampling=bool(select(cfg, "inference.deterministic_sampling", False)),
        threads=int(select(cfg, "inference.threads") or cpu_threads(overlap * num_engines)),
    )


def _workers_per_node(skyrl_cfg: Any, roles: tuple[str, ...]) -> int:
    """Training worker processes on one node: one per GPU slot of each role."""
    placement = skyrl_cfg.trainer.placement
    return sum(int(getattr(placement, f"{role}_num_gpus_per_node")) for role in roles)
