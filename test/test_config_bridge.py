"""Our keys -> SkyRL keys on the real composed config: every pair, the rule between a key and its
SkyRL counterpart, bad keys, and that only the config's content counts.

Configs are composed with Hydra's compose API from the checkout's ``config/``; where a test sets a
key "by content" it writes it into the composed config, which is what a yaml file or a command-line
override also end up as (``test_the_same_settings_resolve_alike_*`` holds that).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from helpers import compose_three_ways, compose_unified
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf, open_dict

from rllm_skyrl.hardware import Platform
from rllm_skyrl.run_config import BRIDGE, ConfigError, make_skyrl_config, resolve_run_config, skyrl_overrides

# One value per bridged source, each different from its default so a missed mapping shows.
BRIDGED_VALUES: dict[str | tuple[str, ...], Any] = {
    "rllm.rollout.n": 5,
    "rllm.rollout.n_val": 3,
    "rllm.data.train_batch_size": 12,
    "rllm.data.max_prompt_length": 333,
    "rllm.data.max_response_length": 77,
    "rllm.rollout.train.temperature": 0.7,
    "rllm.rollout.train.top_p": 0.9,
    "rllm.trainer.save_freq": 7,
    "rllm.trainer.test_freq": 3,
    "rllm.trainer.total_epochs": 4,
    "rllm.algorithm.adv_estimator": "rloo",
    "rllm.algorithm.norm_adv_by_std_in_grpo": False,
    "rllm.algorithm.eps_clip": 0.15,
    "rllm.algorithm.eps_clip_high": 0.28,
    "rllm.algorithm.kl_beta": 0.01,
    "rllm.algorithm.lr_schedule": "cosine",
    "rllm.algorithm.warmup_steps": 9,
    "rllm.algorithm.rollout_correction.tis_mode": "sequence",
    "rllm.algorithm.rollout_correction.tis_cap": 3.5,
    "model.path": "org/model",
    "model.critic_path": "org/critic",
    "model.lora_rank": 8,
    "model.lora_alpha": 32,
    "model.lora_dropout": 0.05,
    "training.learning_rate": 3e-4,
    "training.critic_learning_rate": 2e-4,
    "training.weight_decay": 0.01,
    "training.max_grad_norm": 0.5,
    ("training.beta1", "training.beta2"): [0.8, 0.95],
    "training.update_epochs": 2,
    "training.default_local_dir": "/tmp/elsewhere",
    "inference.num_engines": 3,
}
# A second value per source: a SkyRL counterpart set to its translation disagrees with the first.
OTHER_VALUES: dict[str | tuple[str, ...], Any] = {
    **{source: value * 2 for source, value in BRIDGED_VALUES.items() if type(value) in (int, float)},
    "rllm.algorithm.eps_clip": 0.1,
    "rllm.algorithm.adv_estimator": "grpo",
    "rllm.algorithm.norm_adv_by_std_in_grpo": True,
    "rllm.algorithm.kl_beta": 0.0,
    "rllm.algorithm.lr_schedule": "linear",
    "rllm.algorithm.rollout_correction.tis_mode": "token",
    "model.path": "org/other",
    "model.critic_path": "org/other",
    ("training.beta1", "training.beta2"): [0.9, 0.999],
    "training.default_local_dir": "/tmp/other",
}
# Pairs whose SkyRL key only exists with another setting: the critic's model with GAE.
NEEDS = {"model.critic_path": {"rllm.algorithm.adv_estimator": "gae"}}

N_RLLM, N_SKYRL = "rllm.rollout.n", "skyrl.generator.n_samples_per_prompt"


def _typed(config, dotted: str):
    return functools.reduce(getattr, dotted.split("."), config)


def _with(cfg, settings: dict[str, Any]):
    """``cfg`` with ``settings`` ({dotted key: value}) written into it, as a yaml file would put them."""
    with open_dict(cfg):
        for key, value in settings.items():
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    return cfg


def _source_settings(pair, value) -> dict[str, Any]:
    settings = dict(NEEDS.get(pair.source, {}))
    if isinstance(pair.source, str):
        return {**settings, pair.source: value}
    return {**settings, **(dict(zip(pair.sources, value, strict=True)) if value is not None else {})}


def _pair_id(pair) -> str:
    return f"{'/'.join(pair.sources)}->{pair.skyrl}"


def test_every_bridged_key_has_two_test_values():
    assert set(BRIDGED_VALUES) == set(OTHER_VALUES) == {pair.source for pair in BRIDGE}


@pytest.mark.parametrize("pair", BRIDGE, ids=_pair_id)
def test_pair_maps_its_source_into_skyrl_config(pair):
    value = BRIDGED_VALUES[pair.source]
    overrides = skyrl_overrides(_with(compose_unified(), _source_settings(pair, value)))
    expected = pair.convert(value)
    assert overrides[pair.skyrl] == expected
    # The key exists in SkyRL's typed config and keeps the value through its validation.
    assert _typed(make_skyrl_config(overrides), pair.skyrl) == expected


def test_the_shipped_yaml_sets_no_skyrl_counterpart():
    cfg = compose_unified()
    assert [pair.skyrl for pair in BRIDGE if OmegaConf.select(cfg, f"skyrl.{pair.skyrl}") is not None] == []


def test_rllm_defaults_reach_skyrl_without_any_override():
    """SkyRL's config says what the rLLM config says."""
    cfg = compose_unified()
    skyrl_cfg = make_skyrl_config(skyrl_overrides(cfg))
    assert skyrl_cfg.generator.n_samples_per_prompt == cfg.rllm.rollout.n == cfg.training.group_size
    assert skyrl_cfg.trainer.train_batch_size == cfg.rllm.data.train_batch_size
    assert skyrl_cfg.generator.sampling_params.max_generate_length == cfg.rllm.data.max_response_length
    assert skyrl_cfg.trainer.algorithm.temperature == cfg.rllm.rollout.train.temperature
    assert skyrl_cfg.trainer.policy.optimizer_config.scheduler == "constant_with_warmup"
    assert skyrl_cfg.trainer.policy.optimizer_config.lr == cfg.training.learning_rate
    assert skyrl_cfg.trainer.ckpt_path == cfg.training.default_local_dir


@pytest.mark.parametrize(
    ("schedule", "skyrl_schedule"),
    [("constant", "constant_with_warmup"), ("linear", "linear"), ("cosine", "cosine")],
)
def test_lr_schedule_names_translate(schedule, skyrl_schedule):
    cfg = compose_unified(f"rllm.algorithm.lr_schedule={schedule}")
    overrides = skyrl_overrides(cfg)
    assert overrides["trainer.policy.optimizer_config.scheduler"] == skyrl_schedule
    assert overrides["trainer.critic.optimizer_config.scheduler"] == skyrl_schedule


def test_unknown_lr_schedule_names_the_key():
    cfg = compose_unified("rllm.algorithm.lr_schedule=exponential")
    with pytest.raises(ValueError, match=r"rllm\.algorithm\.lr_schedule='exponential'"):
        skyrl_overrides(cfg)


# --- the rule: the source is the setting, its SkyRL counterpart follows ---------------------------


@pytest.mark.parametrize("pair", BRIDGE, ids=_pair_id)
def test_a_counterpart_that_disagrees_with_its_source_names_both_and_the_one_to_set(pair):
    value, other = BRIDGED_VALUES[pair.source], pair.convert(OTHER_VALUES[pair.source])
    cfg = _with(compose_unified(), {**_source_settings(pair, value), f"skyrl.{pair.skyrl}": other})
    with pytest.raises(ValueError) as caught:
        skyrl_overrides(cfg)
    message = str(caught.value)
    named = value if isinstance(pair.source, str) else value[0]
    assert f"{pair.sources[0]}={named!r}" in message and f"skyrl.{pair.skyrl}={other!r}" in message
    assert f"set {' and '.join(pair.sources)} only" in message


@pytest.mark.parametrize("pair", BRIDGE, ids=_pair_id)
def test_a_counterpart_whose_source_is_null_is_used(pair):
    value = pair.convert(BRIDGED_VALUES[pair.source])
    nulls = {key: None for key in pair.sources}
    cfg = _with(compose_unified(), {**NEEDS.get(pair.source, {}), **nulls, f"skyrl.{pair.skyrl}": value})
    assert skyrl_overrides(cfg)[pair.skyrl] == value


def test_a_counterpart_that_agrees_after_translation_is_fine():
    """``rllm.algorithm.lr_schedule=constant`` and SkyRL's ``constant_with_warmup`` say the same thing."""
    cfg = _with(
        compose_unified("rllm.algorithm.lr_schedule=constant", f"{N_RLLM}=5"),
        {"skyrl.trainer.policy.optimizer_config.scheduler": "constant_with_warmup", N_SKYRL: 5},
    )
    overrides = skyrl_overrides(cfg)
    assert overrides["trainer.policy.optimizer_config.scheduler"] == "constant_with_warmup"
    assert overrides["generator.n_samples_per_prompt"] == 5


def test_a_parent_node_counts_as_the_keys_below_it():
    """``skyrl.generator.sampling_params={temperature: 0.5}`` sets the temperature's counterpart."""
    cfg = compose_unified("+skyrl.generator.sampling_params={temperature:0.5}")
    with pytest.raises(ValueError) as caught:
        skyrl_overrides(cfg)
    message = str(caught.value)
    assert "rllm.rollout.train.temperature=1.0" in message
    assert "skyrl.generator.sampling_params.temperature=0.5" in message


def test_eps_clip_high_mirrors_the_lower_clip_when_neither_side_sets_it():
    cfg = compose_unified("rllm.algorithm.eps_clip=0.1")
    assert cfg.rllm.algorithm.eps_clip_high is None
    assert skyrl_overrides(cfg)["trainer.algorithm.eps_clip_high"] == 0.1


def test_kl_beta_switches_the_kl_loss_on():
    assert skyrl_overrides(compose_unified())["trainer.algorithm.use_kl_loss"] is False
    assert (
        skyrl_overrides(compose_unified("rllm.algorithm.kl_beta=0.01"))["trainer.algorithm.use_kl_loss"]
        is True
    )


# --- only the content counts ----------------------------------------------------------------------

SETTINGS = {
    "model.path": "tiny",
    "rllm.rollout.n": 4,  # an rLLM key
    "training.learning_rate": 3e-4,  # a backend key ...
    "skyrl.trainer.policy.optimizer_config.lr": 3e-4,  # ... and its counterpart, agreeing
    "rllm.algorithm.lr_schedule": "constant",
    "skyrl.trainer.critic.optimizer_config.scheduler": "constant_with_warmup",  # agreeing, translated
    "skyrl.trainer.algorithm.eps_clip_high": 0.3,  # a counterpart whose source is null
    "data.train_batch_size": 8,  # tinker's alias ...
    "rllm.data.train_batch_size": 16,  # ... of a target it overrules
    "skyrl.trainer.seed": 7,  # a SkyRL key with no counterpart
}


def test_the_same_settings_resolve_alike_from_the_command_line_a_yaml_file_and_a_dict(tmp_path):
    runs = {
        route: resolve_run_config(cfg, platform=Platform(cuda=False), resolve_models=False)
        for route, cfg in compose_three_ways(SETTINGS, tmp_path).items()
    }
    first, *others = runs.values()
    assert all(run == first for run in others), list(runs)
    trainer = first.skyrl.trainer
    assert first.rollout_n == first.skyrl.generator.n_samples_per_prompt == 4
    assert trainer.policy.optimizer_config.lr == 3e-4 and trainer.algorithm.eps_clip_high == 0.3
    assert trainer.critic.optimizer_config.scheduler == "constant_with_warmup"
    assert trainer.train_batch_size == 8 and trainer.seed == 7


def test_a_disagreeing_pair_is_the_same_error_from_every_route(tmp_path):
    settings = {"model.path": "tiny", N_RLLM: 5, N_SKYRL: 3}
    messages = set()
    for cfg in compose_three_ways(settings, tmp_path).values():
        with pytest.raises(ConfigError) as caught:
            resolve_run_config(cfg, platform=Platform(cuda=False), resolve_models=False)
        messages.add(str(caught.value))
    assert messages == {
        f"{N_RLLM}=5 and {N_SKYRL}=3 set the same thing differently; set {N_RLLM} only ({N_SKYRL} follows it)"
    }


# --- unknown keys ------------------------------------------------------------------------------


def test_unknown_skyrl_key_on_cli_without_plus_is_refused_by_hydra():
    with pytest.raises(ConfigCompositionException, match=r"skyrl\.trainer\.not_a_key"):
        compose_unified("skyrl.trainer.not_a_key=1")


@pytest.mark.parametrize(
    ("key", "parent", "bad"),
    [
        ("skyrl.trainer.not_a_key", "trainer", "not_a_key"),
        ("skyrl.generator.sampling_params.temprature", "generator.sampling_params", "temprature"),
        ("skyrl.not_a_section.value", "the top level", "not_a_section"),
    ],
)
def test_unknown_skyrl_key_fails_naming_the_key(key, parent, bad):
    """Added in yaml or with ``+``, an unknown key is refused with its full dotted path."""
    cfg = compose_unified(f"+{key}=1")
    with pytest.raises(ValueError) as caught:
        make_skyrl_config(skyrl_overrides(cfg))
    message = str(caught.value)
    assert repr(key.removeprefix("skyrl.")) in message
    assert f"{parent} has no field {bad!r}" in message
