"""Our keys -> SkyRL keys: one table (``BRIDGE``), and the rule between a key and its counterpart.

rLLM users think in ``rllm.rollout.n`` and ``rllm.algorithm.eps_clip``, and this backend's own keys
are tinker's (``training.learning_rate``); SkyRL's workers read ``generator.n_samples_per_prompt``,
``trainer.algorithm.eps_clip_low`` and ``trainer.policy.optimizer_config.lr``. Which side wins,
and which SkyRL keys are derived, is the package docstring's rules 2 and 3.

``rllm.algorithm.loss_fn`` and ``loss_agg_mode`` are not bridged: SkyRL's workers take the loss name
per ``forward_backward`` and expect advantages already scaled for the reduction, so the backend
resolves them per call (``losses.resolve_loss``, ``advantages.apply_loss_reduction``).
"""

from __future__ import annotations

from collections.abc import Callable
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


def _kl_on(beta: Any) -> bool:
    """rLLM's kl_beta is a coefficient; SkyRL needs the loss switched on as well (it adds a ref model)."""
    return float(beta) > 0.0


@dataclass(frozen=True)
class Pair:
    """Our key (or a tuple of keys, whose values ``convert`` gets as a list) and the SkyRL key it sets."""

    source: str | tuple[str, ...]
    skyrl: str
    convert: Callable[[Any], Any] = _identity

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else self.source

    def given(self, cfg: DictConfig) -> dict[str, Any] | None:
        """``{source key: value}`` as set in ``cfg``; None when any source key is null or absent."""
        values = {key: select(cfg, key) for key in self.sources}
        return None if any(value is None for value in values.values()) else values

    def skyrl_value(self, given: dict[str, Any]) -> Any:
        values = list(given.values())
        return self.convert(values[0] if isinstance(self.source, str) else values)


_POLICY, _CRITIC = "trainer.policy.", "trainer.critic."
_CORRECTION = "trainer.algorithm.off_policy_correction."
_BETAS = ("training.beta1", "training.beta2")

BRIDGE: tuple[Pair, ...] = (
    # --- rLLM's keys --------------------------------------------------------------------------------
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
    Pair("rllm.algorithm.kl_beta", "trainer.algorithm.use_kl_loss", _kl_on),
    Pair("rllm.algorithm.lr_schedule", _POLICY + "optimizer_config.scheduler", _scheduler),
    Pair("rllm.algorithm.lr_schedule", _CRITIC + "optimizer_config.scheduler", _scheduler),
    Pair("rllm.algorithm.warmup_steps", _POLICY + "optimizer_config.num_warmup_steps"),
    Pair("rllm.algorithm.warmup_steps", _CRITIC + "optimizer_config.num_warmup_steps"),
    # rLLM's one cap bounds the weight at either level, as verl's rollout_is_threshold does.
    Pair("rllm.algorithm.rollout_correction.tis_mode", _CORRECTION + "tis_ratio_type"),
    Pair("rllm.algorithm.rollout_correction.tis_cap", _CORRECTION + "token_tis_ratio_clip_high"),
    Pair("rllm.algorithm.rollout_correction.tis_cap", _CORRECTION + "sequence_tis_ratio_clip_high"),
    # --- the backend's own keys (tinker's names) ---------------------------------------------------
    Pair("model.path", _POLICY + "model.path"),
    Pair("model.critic_path", _CRITIC + "model.path"),
    Pair("model.lora_rank", _POLICY + "model.lora.rank"),
    Pair("model.lora_alpha", _POLICY + "model.lora.alpha"),
    Pair("model.lora_dropout", _POLICY + "model.lora.dropout"),
    Pair("training.learning_rate", _POLICY + "optimizer_config.lr"),
    Pair("training.critic_learning_rate", _CRITIC + "optimizer_config.lr"),
    Pair("training.weight_decay", _POLICY + "optimizer_config.weight_decay"),
    Pair("training.weight_decay", _CRITIC + "optimizer_config.weight_decay"),
    Pair("training.max_grad_norm", _POLICY + "optimizer_config.max_grad_norm"),
    Pair("training.max_grad_norm", _CRITIC + "optimizer_config.max_grad_norm"),
    Pair(_BETAS, _POLICY + "optimizer_config.adam_betas"),
    Pair(_BETAS, _CRITIC + "optimizer_config.adam_betas"),
    Pair("training.update_epochs", "trainer.update_epochs_per_batch"),
    Pair("training.default_local_dir", "trainer.ckpt_path"),
    Pair("inference.num_engines", "generator.inference_engine.num_engines"),
)


def skyrl_overrides(cfg: DictConfig) -> dict[str, Any]:
    """The flat ``{skyrl_key: value}`` dict for ``SkyRLTrainConfig.from_cli_overrides``; raises
    ``ValueError`` naming both keys when a set SkyRL key disagrees with the key it follows."""
    overrides = {key: value for key, value in flatten(select(cfg, "skyrl") or {}).items() if key}
    for pair in BRIDGE:
        given = pair.given(cfg)
        if given is None:  # the source is null: SkyRL's key, if set, or SkyRL's default
            continue
        value = pair.skyrl_value(given)
        if overrides.get(pair.skyrl) is not None and overrides[pair.skyrl] != value:
            raise ValueError(disagreement(given, value, f"skyrl.{pair.skyrl}", overrides[pair.skyrl]))
        overrides[pair.skyrl] = value
    algorithm = "trainer.algorithm."
    overrides.setdefault(algorithm + "use_kl_loss", _kl_on(overrides.get(algorithm + "kl_loss_coef") or 0))
    if overrides.get(algorithm + "eps_clip_high") is None:  # symmetric clipping unless asked otherwise
        overrides[algorithm + "eps_clip_high"] = overrides.get(algorithm + "eps_clip_low", 0.2)
    _derive_batch_layout(cfg, overrides)
    _derive_models(overrides)
    return overrides


def disagreement(given: dict[str, Any], converted: Any, skyrl_key: str, skyrl_value: Any) -> str:
    """One line naming both sides of a pair that disagree, and the one to set."""
    ours = ", ".join(f"{key}={value!r}" for key, value in given.items())
    plain = list(given.values())
    if converted != (plain[0] if len(plain) == 1 else plain):
        ours += f" (SkyRL's {converted!r})"
    keys = " and ".join(given)
    return (
        f"{ours} and {skyrl_key}={skyrl_value!r} set the same thing differently; set {keys} only "
        f"({skyrl_key} follows {'it' if len(given) == 1 else 'them'})"
    )


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


def _derive_models(overrides: dict[str, Any]) -> None:
    """A critic exists exactly when the estimator needs one (GAE); a ref exists when KL is on."""
    policy_path = overrides.get(_POLICY + "model.path")
    if overrides.get("trainer.algorithm.advantage_estimator") == "gae":
        overrides.setdefault(_CRITIC + "model.path", policy_path)
    else:
        overrides.pop(_CRITIC + "model.path", None)
    overrides.setdefault("trainer.ref.model.path", policy_path)
