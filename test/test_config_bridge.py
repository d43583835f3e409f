"""rLLM keys -> SkyRL keys on the real composed config: every pair, the precedence rule, bad keys.

Configs are composed with Hydra's compose API from the checkout's ``config/``. The
overrides given to ``compose`` put values into the config; the ``cli`` list given to
``skyrl_overrides`` says which of them came from the command line, so one composition can play
"set in yaml" or "set on the command line" for the same key.
"""

from __future__ import annotations

import functools

import pytest
from helpers import compose_unified
from hydra.errors import ConfigCompositionException

from rllm_skyrl.run_config import BRIDGE, make_skyrl_config, skyrl_overrides

# One value per bridged rLLM key, each different from its default so a missed mapping shows.
BRIDGED_VALUES = {
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
}

N_RLLM, N_SKYRL = "rllm.rollout.n", "skyrl.generator.n_samples_per_prompt"


def _typed(config, dotted: str):
    return functools.reduce(getattr, dotted.split("."), config)


def test_every_bridged_key_has_a_test_value():
    assert set(BRIDGED_VALUES) == {pair.rllm for pair in BRIDGE}


@pytest.mark.parametrize("pair", BRIDGE, ids=lambda pair: f"{pair.rllm}->{pair.skyrl}")
def test_pair_maps_rllm_value_into_skyrl_config(pair):
    value = BRIDGED_VALUES[pair.rllm]
    cli = [f"{pair.rllm}={value}"]
    cfg = compose_unified(*cli)
    overrides = skyrl_overrides(cfg, cli)
    expected = pair.convert(value)
    assert overrides[pair.skyrl] == expected
    # The key exists in SkyRL's typed config and keeps the value through its validation.
    assert _typed(make_skyrl_config(overrides), pair.skyrl) == expected


def test_rllm_defaults_reach_skyrl_without_any_override():
    """rLLM yaml beats SkyRL's own defaults: SkyRL's config says what the rLLM config says."""
    cfg = compose_unified()
    skyrl_cfg = make_skyrl_config(skyrl_overrides(cfg))
    assert skyrl_cfg.generator.n_samples_per_prompt == cfg.rllm.rollout.n == cfg.training.group_size
    assert skyrl_cfg.trainer.train_batch_size == cfg.rllm.data.train_batch_size
    assert skyrl_cfg.generator.sampling_params.max_generate_length == cfg.rllm.data.max_response_length
    assert skyrl_cfg.trainer.algorithm.temperature == cfg.rllm.rollout.train.temperature
    assert skyrl_cfg.trainer.policy.optimizer_config.scheduler == "constant_with_warmup"


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


# --- precedence: rLLM CLI > SkyRL CLI > rLLM yaml > SkyRL yaml -----------------------------------


def test_rllm_yaml_beats_skyrl_yaml():
    cfg = compose_unified(f"+{N_SKYRL}=3")
    assert skyrl_overrides(cfg, cli_overrides=[])["generator.n_samples_per_prompt"] == cfg.rllm.rollout.n == 8


def test_skyrl_cli_beats_rllm_yaml():
    cli = [f"+{N_SKYRL}=3"]
    assert skyrl_overrides(compose_unified(*cli), cli)["generator.n_samples_per_prompt"] == 3


def test_rllm_cli_beats_skyrl_yaml():
    cli = [f"{N_RLLM}=5"]
    cfg = compose_unified(f"+{N_SKYRL}=3", *cli)
    assert skyrl_overrides(cfg, cli)["generator.n_samples_per_prompt"] == 5


def test_both_on_cli_with_the_same_value_is_fine():
    cli = [f"{N_RLLM}=5", f"+{N_SKYRL}=5"]
    assert skyrl_overrides(compose_unified(*cli), cli)["generator.n_samples_per_prompt"] == 5


@pytest.mark.parametrize("prefix", ["+", "++"])
def test_both_on_cli_with_different_values_names_both_keys(prefix):
    cli = [f"{N_RLLM}=5", f"{prefix}{N_SKYRL}=3"]
    with pytest.raises(ValueError, match="conflicting overrides") as caught:
        skyrl_overrides(compose_unified(*cli), cli)
    assert N_RLLM in str(caught.value) and N_SKYRL in str(caught.value)


def test_conflict_check_uses_converted_values():
    """``rllm.algorithm.lr_schedule=constant`` and SkyRL's ``constant_with_warmup`` say the same thing."""
    cli = [
        "rllm.algorithm.lr_schedule=constant",
        "skyrl.trainer.policy.optimizer_config.scheduler=constant_with_warmup",
    ]
    cfg = compose_unified(*[f"+{o}" if o.startswith("skyrl") else o for o in cli])
    overrides = skyrl_overrides(cfg, cli)
    assert overrides["trainer.policy.optimizer_config.scheduler"] == "constant_with_warmup"


def test_skyrl_cli_on_a_parent_node_counts_for_the_keys_below_it():
    """``skyrl.generator.sampling_params={...}`` on the command line sets the temperature pair too."""
    cli = ["+skyrl.generator.sampling_params={temperature:0.5}"]
    overrides = skyrl_overrides(compose_unified(*cli), cli)
    assert overrides["generator.sampling_params.temperature"] == 0.5
    # The pair's other SkyRL key was not on the command line: the rLLM value still feeds it.
    assert overrides["trainer.algorithm.temperature"] == 1.0


def test_null_rllm_value_keeps_skyrl_value():
    """rLLM's ``null`` means "backend default": the SkyRL side (yaml or SkyRL's default) stays."""
    cfg = compose_unified("+skyrl.trainer.algorithm.eps_clip_high=0.3")
    assert cfg.rllm.algorithm.eps_clip_high is None
    assert skyrl_overrides(cfg)["trainer.algorithm.eps_clip_high"] == 0.3
    # Neither side set: the upper clip mirrors the lower one (symmetric clipping).
    assert (
        skyrl_overrides(compose_unified("rllm.algorithm.eps_clip=0.1"))["trainer.algorithm.eps_clip_high"]
        == 0.1
    )


def test_kl_beta_switches_the_kl_loss_on():
    assert skyrl_overrides(compose_unified())["trainer.algorithm.use_kl_loss"] is False
    assert (
        skyrl_overrides(compose_unified("rllm.algorithm.kl_beta=0.01"))["trainer.algorithm.use_kl_loss"]
        is True
    )


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
