"""Tinker loss names/configs -> SkyRL: every name x config, checked where SkyRL reads it."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch
from omegaconf import OmegaConf
from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry, ppo_critic_loss
from skyrl.train.config import AlgorithmConfig

from rllm_skyrl.run_config.losses import LOSS_NAMES, accepted_config_keys, resolve_loss


def merged_algorithm_config(skyrl_config: dict) -> AlgorithmConfig:
    """What the policy worker does with loss_fn_config (workers/worker.py, _forward_backward_micro)."""
    base = AlgorithmConfig()
    merged = OmegaConf.merge(OmegaConf.create(asdict(base)), OmegaConf.create(skyrl_config))
    return type(base).from_dict_config(merged)


# (role, loss_fn, loss_fn_config, SkyRL loss name, {dotted AlgorithmConfig field: expected value})
ACCEPTED = [
    ("policy", "ppo", None, "regular", {"policy_loss_type": "regular"}),
    (
        "policy",
        "ppo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        "regular",
        {"eps_clip_low": 0.2, "eps_clip_high": 0.2},
    ),
    ("policy", "ppo", {"clip_high_threshold": 1.28}, "regular", {"eps_clip_high": 0.28, "eps_clip_low": 0.2}),
    ("policy", "ppo", {"clip_low_threshold": 0.0}, "regular", {"eps_clip_low": 1.0}),
    ("policy", "importance_sampling", {}, "importance_sampling", {"policy_loss_type": "importance_sampling"}),
    ("policy", "gspo", None, "gspo", {"policy_loss_type": "gspo", "loss_reduction": "sequence_mean"}),
    (
        "policy",
        "gspo",
        {"clip_low_threshold": 0.9997, "clip_high_threshold": 1.0004},
        "gspo",
        {"eps_clip_low": 0.0003, "eps_clip_high": 0.0004},
    ),
    ("policy", "cispo", None, "cispo", {"cispo.cispo_eps_clip_low": 1.0, "cispo.cispo_eps_clip_high": 4.0}),
    (
        "policy",
        "cispo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        "cispo",
        {"cispo.cispo_eps_clip_low": 0.2, "cispo.cispo_eps_clip_high": 0.2, "eps_clip_low": 0.2},
    ),
    ("policy", "cispo", {"cispo_anchor": "rollout"}, "cispo", {"cispo.cispo_anchor": "rollout"}),
    ("policy", "dppo", None, "dppo", {"dppo.delta_low": 0.2, "dppo.dppo_type": "binary_tv"}),
    (
        "policy",
        "dppo",
        {"delta_low": 0.05, "delta_high": 0.1, "dppo_type": "binary_kl"},
        "dppo",
        {"dppo.delta_low": 0.05, "dppo.delta_high": 0.1, "dppo.dppo_type": "binary_kl"},
    ),
    ("policy", "cross_entropy", None, "cross_entropy", {"policy_loss_type": "cross_entropy"}),
    ("critic", "ppo_critic", None, None, {}),
    ("critic", "ppo", None, None, {}),
    ("critic", "ppo_critic", {"value_clip": 0.5}, None, {"value_clip": 0.5}),
    ("critic", "ppo", {"value_clip": None}, None, {"value_clip": None}),
]

# (role, loss_fn, loss_fn_config, substrings the error must contain)
REJECTED = [
    ("policy", "ppo", {"eps_clip_low": 0.2}, ["'eps_clip_low'", "clip_low_threshold", "clip_high_threshold"]),
    ("policy", "importance_sampling", {"clip_low_threshold": 0.8}, ["accepts no config keys"]),
    ("policy", "cross_entropy", {"clip_high_threshold": 1.2}, ["accepts no config keys"]),
    ("policy", "dppo", {"clip_low_threshold": 0.8}, ["delta_low", "delta_high", "dppo_type"]),
    ("policy", "cispo", {"delta_low": 0.1}, ["clip_low_threshold", "cispo_anchor"]),
    ("policy", "ppo", {"clip_low_threshold": 1.5}, ["clip_low_threshold", "[0, 1]", "1.5"]),
    ("policy", "cispo", {"clip_high_threshold": 0.9}, ["clip_high_threshold", ">= 1", "0.9"]),
    ("policy", "ppo", {"clip_low_threshold": True}, ["finite number"]),
    ("policy", "ppo", {"clip_high_threshold": float("nan")}, ["finite number"]),
    ("policy", "ppo", {"clip_high_threshold": "1.2"}, ["finite number"]),
    ("policy", "dppo", {"delta_low": 0.0}, ["delta_low", "> 0"]),
    ("policy", "dppo", {"dppo_type": "tv"}, ["binary_tv", "binary_kl"]),
    ("policy", "cispo", {"cispo_anchor": "new"}, ["old", "rollout"]),
    ("critic", "ppo_critic", {"value_clip": -1.0}, ["value_clip", ">= 0"]),
    ("critic", "ppo", {"clip_low_threshold": 0.8}, ["'ppo_critic'", "value_clip"]),
    ("critic", "cispo", None, ["critic trains with loss_fn='ppo_critic'", "'cispo'"]),
    ("critic", "cross_entropy", None, ["critic trains with"]),
    ("policy", "ppo_critic", None, ["use it on the critic", "importance_sampling"]),
    ("ref", "ppo", None, ["unknown model role 'ref'"]),
    ("policy", "grpo", None, ["unknown loss_fn 'grpo'", "cispo", "gspo", "ppo_critic"]),
    ("policy", "gspo", {"delta_low": 0.1}, ["clip_low_threshold", "clip_high_threshold"]),
]


def field_value(config: AlgorithmConfig, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(("role", "loss_fn", "config", "skyrl_name", "expected"), ACCEPTED)
def test_accepted_configs_land_on_skyrl_fields(role, loss_fn, config, skyrl_name, expected):
    resolved = resolve_loss(role, loss_fn, config)
    assert resolved.skyrl_loss_name == skyrl_name
    assert resolved.role == role
    if skyrl_name is None:
        assert resolved.trains_critic and resolved.loss_fn == "ppo_critic"
        assert resolved.dispatch_kwargs() == {}
        assert resolved.skyrl_config == expected  # kwargs for dispatch.set_algorithm_config("critic", ...)
        return
    assert skyrl_name in PolicyLossRegistry.list_available()
    assert resolved.dispatch_kwargs() == {"loss_fn": skyrl_name, "loss_fn_config": resolved.skyrl_config}
    merged = merged_algorithm_config(resolved.skyrl_config)
    assert merged.policy_loss_type == skyrl_name
    for dotted, value in expected.items():
        actual = field_value(merged, dotted)
        assert actual == (pytest.approx(value) if isinstance(value, float) else value), dotted


@pytest.mark.parametrize(("role", "loss_fn", "config", "fragments"), REJECTED)
def test_rejected_requests_say_what_is_accepted(role, loss_fn, config, fragments):
    with pytest.raises(ValueError) as err:
        resolve_loss(role, loss_fn, config)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_tables_cover_every_name_and_key():
    assert set(LOSS_NAMES) == {
        "ppo",
        "importance_sampling",
        "cispo",
        "dppo",
        "gspo",
        "cross_entropy",
        "ppo_critic",
    }
    accepted_names = {loss_fn for _, loss_fn, *_ in ACCEPTED}
    assert accepted_names == set(LOSS_NAMES)
    used_keys = {(loss_fn, key) for _, loss_fn, config, *_ in ACCEPTED for key in (config or {})}
    for name in LOSS_NAMES:
        for key in accepted_config_keys(name):
            assert (name, key) in used_keys or (name == "ppo_critic" and ("ppo", key) in used_keys)


def test_advantage_use_is_reported():
    assert not resolve_loss("policy", "cross_entropy").uses_advantages
    assert not resolve_loss("critic", "ppo").uses_advantages
    assert all(
        resolve_loss("policy", name).uses_advantages
        for name in ("ppo", "importance_sampling", "cispo", "dppo", "gspo")
    )


def run_policy_loss(loss_fn: str, config: dict | None, log_ratio: float, advantage: float = 1.0):
    """One token, one row: call the SkyRL loss the worker would call, with the merged config."""
    resolved = resolve_loss("policy", loss_fn, config)
    algorithm = merged_algorithm_config(resolved.skyrl_config)
    old_BT = torch.tensor([[-1.0]])
    new_BT = old_BT + log_ratio
    loss, _ = PolicyLossRegistry.get(resolved.skyrl_loss_name)(
        new_BT,
        old_BT,
        torch.tensor([[advantage]]),
        config=algorithm,
        loss_mask=torch.ones(1, 1),
        rollout_logprobs=old_BT,
    )
    return loss.item(), new_BT.item()


@pytest.mark.parametrize(
    ("low", "high", "ratio", "advantage", "effective_ratio"),
    [
        (0.8, 1.2, 1.5, 1.0, 1.2),  # clipped from above for a positive advantage
        (0.8, 1.2, 1.1, 1.0, 1.1),  # inside the trust region
        (0.9, 1.1, 1.5, 1.0, 1.1),
        (0.8, 1.2, 0.5, -1.0, 0.8),  # clipped from below for a negative advantage
    ],
)
def test_ppo_thresholds_are_the_ratio_bounds_skyrl_applies(low, high, ratio, advantage, effective_ratio):
    config = {"clip_low_threshold": low, "clip_high_threshold": high}
    loss, _ = run_policy_loss("ppo", config, math.log(ratio), advantage)
    assert loss == pytest.approx(-effective_ratio * advantage, rel=1e-5)


@pytest.mark.parametrize(("ratio", "clamped"), [(1.5, 1.2), (0.5, 0.8), (1.1, 1.1)])
def test_cispo_thresholds_clamp_the_detached_weight(ratio, clamped):
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    loss, logprob = run_policy_loss("cispo", config, math.log(ratio))
    assert loss == pytest.approx(-clamped * logprob, rel=1e-5)


def test_dppo_delta_masks_tokens_whose_probability_moved_too_far():
    # p_old = e^-1 = 0.37; ratio 1.5 moves p by 0.18: kept under delta_high 0.2, masked under 0.1.
    kept, _ = run_policy_loss("dppo", {"delta_high": 0.2}, math.log(1.5))
    masked, _ = run_policy_loss("dppo", {"delta_high": 0.1}, math.log(1.5))
    assert kept == pytest.approx(-1.5, rel=1e-5)
    assert masked == 0.0


def test_unclipped_losses_ignore_the_ratio_bounds():
    loss, _ = run_policy_loss("importance_sampling", None, math.log(3.0))
    assert loss == pytest.approx(-3.0, rel=1e-5)
    loss, logprob = run_policy_loss("cross_entropy", None, 0.0)
    assert loss == pytest.approx(-logprob)


@pytest.mark.parametrize(
    ("value_clip", "expected"), [(0.5, 0.5 * (0.5 - 2.0) ** 2), (None, 0.5 * (1.2 - 2.0) ** 2)]
)
def test_critic_value_clip_reaches_skyrl_critic_loss(value_clip, expected):
    resolved = resolve_loss("critic", "ppo_critic", {"value_clip": value_clip})
    algorithm = AlgorithmConfig(**resolved.skyrl_config)  # what set_algorithm_config sets on the worker
    # The value moved 1.2 from its old estimate; clipping to 0.5 leaves it further from the return.
    values_BT, old_values_BT, returns_BT = torch.tensor([[1.2]]), torch.tensor([[0.0]]), torch.tensor([[2.0]])
    loss, _ = ppo_critic_loss(
        values_BT, old_values_BT, returns_BT, config=algorithm, loss_mask=torch.ones(1, 1)
    )
    assert loss.item() == pytest.approx(expected)


def test_gspo_clips_the_sequence_ratio_where_ppo_clips_each_token():
    """Two tokens of one sequence, one pushed far up and one down: PPO clips the first token alone;
    GSPO weighs both by the sequence's geometric-mean ratio, inside the bounds here, so neither is."""
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    old_BT = torch.tensor([[-1.0, -1.0]])
    new_BT = old_BT + torch.tensor([[math.log(1.5), math.log(0.8)]])  # geometric mean sqrt(1.2) ~ 1.095
    advantages_BT = torch.ones(1, 2)
    losses = {}
    for loss_fn in ("ppo", "gspo"):
        resolved = resolve_loss("policy", loss_fn, config)
        loss, metrics = PolicyLossRegistry.get(resolved.skyrl_loss_name)(
            new_BT.clone().requires_grad_(),
            old_BT,
            advantages_BT,
            config=merged_algorithm_config(resolved.skyrl_config),
            loss_mask=torch.ones(1, 2),
            rollout_logprobs=old_BT,
        )
        losses[loss_fn] = (loss.item(), metrics["clip_ratio"])
    sequence_ratio = math.sqrt(1.5 * 0.8)
    assert losses["ppo"] == pytest.approx((-(1.2 + 0.8), 0.5), rel=1e-5)  # token 1 clipped at 1.2
    assert losses["gspo"] == pytest.approx((-2 * sequence_ratio, 0.0), rel=1e-5)
