"""rLLM keys -> SkyRL keys: one table, one precedence rule.

rLLM users think in ``rllm.rollout.n`` and ``rllm.algorithm.eps_clip``; SkyRL's workers read
``generator.n_samples_per_prompt`` and ``trainer.algorithm.eps_clip_low``. Every pair that means
the same thing is listed once in ``BRIDGE``. For each pair the value comes from, in order:

    rLLM key on the command line > SkyRL key on the command line > rLLM yaml > SkyRL yaml

so a SkyRL-side yaml default never silently beats what the rLLM config says, while a SkyRL
expert can still set the native key on the command line. Both sides on the command line with
different values is an error naming both keys.

``rllm.algorithm.loss_fn`` and ``loss_agg_mode`` are not bridged: the backend resolves them per
call (``losses.resolve_loss``, ``advantages.apply_loss_reduction``), because SkyRL's workers take
the loss name per ``forward_backward`` and expect advantages already scaled for the reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from rllm_skyrl.run_config.tree import flatten, select

_SCHEDULERS = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def _scheduler(value: str) -> str:
    if value not in _SCHEDULERS:
        raise ValueError(f"rllm.algorithm.lr_schedule={value!r}: expected one of {sorted(_SCHEDULERS)}")
    return _SCHEDULERS[value]


def _identity(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Pair:
    """One rLLM key and the SkyRL key it maps to; ``convert`` turns rLLM values into SkyRL values."""

    rllm: str
    skyrl: str
    convert: Callable[[Any], Any] = _identity


BRIDGE: tuple[Pair, ...] = (
    Pair("rllm.rollout.n", "generator.n_samples_per_prompt"),
    Pair("rllm.rollout.n_val", "generator.eval_n_samples_per_prompt"),
    Pair("rllm.data.train_batch_size", "trainer.train_batch_size"),
    Pair("rllm.data.max_prompt_length", "trainer.max_prompt_length"),
    Pair("rllm.data.max_response_length", "generator.sampling_params.max_generate_length"),
    Pair("rllm.rollout.train.temperature", "generator.sampling_params.temperature"),
    Pair("rllm.rollout.train.top_p", "generator.sampling_params.top_p"),
    Pair("rllm.rollout.train.temperature", "trainer.algorithm.temperature"),
    Pair("rllm.trainer.save_freq", "trainer.ckpt_interval"),
    Pair("rllm.trainer.test_freq", "trainer.eval_interval"),
    Pair("rllm.trainer.total_epochs", "trainer.epochs"),
    Pair("rllm.algorithm.adv_estimator", "trainer.algorithm.advantage_estimator"),
    Pair("rllm.algorithm.norm_adv_by_std_in_grpo", "trainer.algorithm.grpo_norm_by_std"),
    Pair("rllm.algorithm.eps_clip", "trainer.algorithm.eps_clip_low"),
    Pair("rllm.algorithm.eps_clip_high", "trainer.algorithm.eps_clip_high"),
    Pair("rllm.algorithm.kl_beta", "trainer.algorithm.kl_loss_coef"),
    Pair("rllm.algorithm.lr_schedule", "trainer.policy.optimizer_config.scheduler", _scheduler),
    Pair("rllm.algorithm.lr_schedule", "trainer.critic.optimizer_config.scheduler", _scheduler),
    Pair("rllm.algorithm.warmup_steps", "trainer.policy.optimizer_config.num_warmup_steps"),
    Pair("rllm.algorithm.warmup_steps", "trainer.critic.optimizer_config.num_warmup_steps"),
    # The backend's own key: how many servers to start, SkyRL's vLLM servers included.
    Pair("inference.num_engines", "generator.inference_engine.num_engines"),
)


def cli_keys(cli_overrides: Iterable[str]) -> dict[str, str]:
    """``key=value`` overrides (Hydra's ``+``/``++``/``~`` prefixes stripped) -> {key: raw value}."""
    keys = {}
    for override in cli_overrides:
        key, _, value = override.lstrip("+~").partition("=")
        keys[key.strip()] = value
    return keys


def on_cli(key: str, cli: dict[str, str]) -> bool:
    """Whether ``key`` or a node above it (``skyrl.generator.sampling_params={...}``) was set on the CLI."""
    parts = key.split(".")
    return any(".".join(parts[:depth]) in cli for depth in range(1, len(parts) + 1))


def skyrl_overrides(cfg: DictConfig, cli_overrides: Iterable[str] = ()) -> dict[str, Any]:
    """The flat ``{skyrl_key: value}`` dict for ``SkyRLTrainConfig.from_cli_overrides``.

    ``cli_overrides`` are the run's command-line overrides (Hydra's ``overrides.task``); they only
    decide precedence, their values are already in ``cfg``.
    """
    skyrl_tree = select(cfg, "skyrl") or {}
    overrides = {key: value for key, value in flatten(skyrl_tree).items() if key}
    cli = cli_keys(cli_overrides)

    for pair in BRIDGE:
        skyrl_on_cli = on_cli(f"skyrl.{pair.skyrl}", cli)
        rllm_on_cli = on_cli(pair.rllm, cli)
        rllm_value = select(cfg, pair.rllm)
        if skyrl_on_cli and not rllm_on_cli:
            continue
        if rllm_value is None:  # rLLM's "backend default": keep SkyRL's value
            continue
        converted = pair.convert(rllm_value)
        if skyrl_on_cli and rllm_on_cli and overrides.get(pair.skyrl) != converted:
            raise ValueError(
                f"conflicting overrides: {pair.rllm}={rllm_value!r} and skyrl.{pair.skyrl}="
                f"{overrides.get(pair.skyrl)!r} set the same thing; drop one of them"
            )
        overrides[pair.skyrl] = converted

    algorithm = "trainer.algorithm."
    # rLLM's kl_beta is a coefficient; SkyRL needs the loss switched on as well (it adds a ref model).
    overrides[algorithm + "use_kl_loss"] = float(overrides.get(algorithm + "kl_loss_coef") or 0.0) > 0.0
    if overrides.get(algorithm + "eps_clip_high") is None:
        overrides[algorithm + "eps_clip_high"] = overrides.get(algorithm + "eps_clip_low", 0.2)
    _derive_batch_layout(cfg, overrides)
    _derive_models(cfg, overrides)
    return overrides


def _derive_batch_layout(cfg: DictConfig, overrides: dict[str, Any]) -> None:
    """Mini-batches are counted in tasks by SkyRL; ``training.num_minibatches`` splits a batch evenly."""
    batch = int(overrides.get("trainer.train_batch_size", 1))
    minibatches = int(select(cfg, "training.num_minibatches") or 1)
    if minibatches < 1 or batch % minibatches:
        raise ValueError(
            f"training.num_minibatches={minibatches} must divide rllm.data.train_batch_size={batch}"
        )
    overrides.setdefault("trainer.policy_mini_batch_size", batch // minibatches)
    overrides.setdefault("trainer.critic_mini_batch_size", batch // minibatches)
    overrides.setdefault("trainer.update_epochs_per_batch", int(select(cfg, "training.update_epochs") or 1))


def _derive_models(cfg: DictConfig, overrides: dict[str, Any]) -> None:
    """A critic exists exactly when the estimator needs one (GAE); a ref exists when KL is on."""
    policy_path = overrides.get("trainer.policy.model.path")
    if overrides.get("trainer.algorithm.advantage_estimator") == "gae":
        overrides["trainer.critic.model.path"] = select(cfg, "model.critic_path") or policy_path
    else:
        overrides.pop("trainer.critic.model.path", None)
    overrides.setdefault("trainer.ref.model.path", policy_path)
