"""Keys of rLLM's tinker and verl backends: every one accepted under its own name, with its effect,
or refused naming the key and why; the yaml, the table and the README agree.

Composed with the packaged config, and with rLLM's own ``unified`` config when rLLM is installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import compose_three_ways
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from rllm_skyrl.hardware import Platform
from rllm_skyrl.run_config import ConfigError, resolve_run_config, with_aliases
from rllm_skyrl.run_config.aliases import KEYS, Alias, Refused, alias_values, table_markdown
from rllm_skyrl.run_config.tree import select

README = Path(__file__).resolve().parent.parent / "README.md"
CONFIG_MODULES = ["rllm_skyrl.config"] + (
    ["rllm.trainer.config"] if importlib.util.find_spec("rllm") is not None else []
)

# A value per alias, different from every default, valid for its target.
VALUES = {
    "model.name": "tiny",
    "actor_rollout_ref.model.path": "tiny",
    "actor_rollout_ref.model.lora_rank": 8,
    "actor_rollout_ref.model.lora.rank": 16,
    "actor_rollout_ref.model.lora_alpha": 32,
    "actor_rollout_ref.model.lora.alpha": 8,
    "actor_rollout_ref.model.target_modules": ["q_proj", "v_proj"],
    "critic.model.path": "tiny",
    "training.lr_schedule": "cosine",
    "training.warmup_steps_ratio": 0.25,
    "training.max_length": 96,
    "actor_rollout_ref.rollout.max_model_len": 96,
    "data.train_batch_size": 12,
    "data.val_batch_size": 5,
    "data.max_prompt_length": 33,
    "data.max_response_length": 7,
    "rollout_engine.disable_thinking": True,
    "rollout_engine.accumulate_reasoning": True,
    "sampling.train.temperature": 0.7,
    "sampling.train.top_p": 0.9,
    "sampling.val.temperature": 0.6,
    "sampling.val.top_p": 0.8,
    "workflow.n_parallel_tasks": 17,
    "workflow.retry_limit": 2,
    "actor_rollout_ref.actor.optim.lr": 3e-5,
    "actor_rollout_ref.actor.optim.weight_decay": 0.05,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": 4,
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.1,
    "actor_rollout_ref.actor.grad_clip": 0.5,
    "actor_rollout_ref.actor.ppo_epochs": 2,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 3,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 5,
    "actor_rollout_ref.actor.clip_ratio": 0.15,
    "actor_rollout_ref.actor.clip_ratio_low": 0.15,
    "actor_rollout_ref.actor.clip_ratio_high": 0.28,
    "actor_rollout_ref.actor.kl_loss_coef": 0.01,
    "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "cispo",
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.rollout.n": 5,
    "actor_rollout_ref.rollout.val_kwargs.n": 3,
    "actor_rollout_ref.rollout.temperature": 0.7,
    "actor_rollout_ref.rollout.top_p": 0.9,
    "actor_rollout_ref.rollout.top_k": 40,
    "actor_rollout_ref.rollout.response_length": 11,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0.6,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 0.8,
    "actor_rollout_ref.rollout.val_kwargs.top_k": 30,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.55,
    "actor_rollout_ref.rollout.enforce_eager": True,
    "critic.optim.lr": 7e-6,
    "algorithm.adv_estimator": "rloo",
    "algorithm.norm_adv_by_std_in_grpo": False,
    "algorithm.gamma": 0.99,
    "algorithm.lam": 0.95,
    "algorithm.rollout_correction.bypass_mode": False,
    "trainer.n_gpus_per_node": 4,
    "trainer.nnodes": 2,
    "trainer.total_epochs": 3,
    "trainer.total_training_steps": 9,
    "trainer.save_freq": 6,
    "trainer.test_freq": 4,
    "trainer.val_before_train": True,
    "trainer.project_name": "proj",
    "trainer.experiment_name": "exp",
    "trainer.logger": ["console"],
    "trainer.default_local_dir": "/tmp/somewhere",
    "trainer.resume_mode": "disable",
    "trainer.max_actor_ckpt_to_keep": 3,
}
# A value each refused key must refuse.
REFUSED_VALUES = {
    "training.eps": 1e-6,
    "model.train_unembed": True,
    "data.train_files": "train.parquet",
    "data.val_files": "val.parquet",
    "rollout_engine.renderer_name": "qwen3",
    "tinker_base_url": "http://tinker",
    "fuse_forward_backward_and_optim_step": True,
    "agent.max_steps": 3,
    "agent.agent_args": "{a: 1}",
    "actor_rollout_ref.rollout.name": "sglang",
    "actor_rollout_ref.rollout.mode": "sync",
    "actor_rollout_ref.actor.use_kl_loss": True,
    "trainer.critic_warmup": 2,
    "rollout.nnodes": 1,
    "rollout.n_gpus_per_node": 8,
}


def _override(key: str, value) -> str:
    if isinstance(value, list):
        return f"{key}=[{','.join(value)}]"
    return f"{key}={value}"


def compose_config(module: str, *overrides: str, model: bool = True):
    with initialize_config_module(module, version_base=None):
        base = ["rllm/backend=skyrl"] if module != "rllm_skyrl.config" else []
        return compose("unified", overrides=[*base, *(["model.path=tiny"] if model else []), *overrides])


def test_every_key_has_a_test_value():
    assert {s.key for s in KEYS if isinstance(s, Alias)} == set(VALUES)
    assert {s.key for s in KEYS if isinstance(s, Refused)} == set(REFUSED_VALUES)


@pytest.mark.parametrize("module", CONFIG_MODULES)
@pytest.mark.parametrize("spec", [s for s in KEYS if isinstance(s, Alias)], ids=lambda s: s.key)
def test_alias_reaches_its_target_in_a_new_config(module, spec):
    value = VALUES[spec.key]
    cfg = compose_config(module, _override(spec.key, value), model=spec.target != "model.path")
    given = OmegaConf.to_container(cfg)
    assert alias_values(cfg) == {spec.target: value}
    assert select(with_aliases(cfg), spec.target) == value
    assert OmegaConf.to_container(cfg) == given  # the config given is left as it was


@pytest.mark.parametrize("module", CONFIG_MODULES)
@pytest.mark.parametrize("spec", [s for s in KEYS if isinstance(s, Refused)], ids=lambda s: s.key)
def test_refused_key_names_itself_and_why(module, spec):
    cfg = compose_config(module, _override(spec.key, REFUSED_VALUES[spec.key]))
    with pytest.raises(ConfigError) as caught:
        resolve_run_config(cfg, resolve_models=False)
    assert spec.key in str(caught.value) and spec.why.split(";")[0] in str(caught.value)
    inert = compose_config(module, *([] if spec.inert[-1] is None else [_override(spec.key, spec.inert[-1])]))
    with_aliases(inert)  # a value that asks for nothing passes


def test_a_tinker_command_line_carries_over():
    """The overrides rLLM's tinker scripts pass, with rllm/backend=skyrl instead of tinker."""
    cli = [
        "model.name=tiny",
        "data.train_batch_size=32",
        "data.val_batch_size=256",
        "data.max_prompt_length=4096",
        "data.max_response_length=1024",
        "training.max_length=8192",
        "training.lr_schedule=cosine",
        "training.warmup_steps_ratio=0.1",
        "rollout_engine.disable_thinking=true",
    ]
    for module in CONFIG_MODULES:
        cfg = compose_config(module, *cli)
        run = resolve_run_config(cfg, resolve_models=False)
        assert run.model_path == "tiny" and run.max_prompt_length == 4096 and run.max_response_length == 1024
        assert run.skyrl.trainer.train_batch_size == 32 and with_aliases(cfg).rllm.data.val_batch_size == 256
        assert run.inference.max_model_len == 8192 and run.warmup_steps_ratio == 0.1
        assert run.skyrl.trainer.policy.optimizer_config.scheduler == "cosine"
        assert run.rollout.disable_thinking is True


def test_a_set_alias_overrules_its_target_from_every_route(tmp_path):
    """rLLM's base config gives the target a value, so only the alias says what the user wants."""
    settings = {"model.path": "tiny", "data.train_batch_size": 8, "rllm.data.train_batch_size": 16}
    for route, cfg in compose_three_ways(settings, tmp_path).items():
        run = resolve_run_config(cfg, platform=Platform(cuda=False), resolve_models=False)
        assert run.skyrl.trainer.train_batch_size == 8, route
        assert with_aliases(cfg).rllm.data.train_batch_size == 8, route


def test_two_aliases_of_one_target_that_disagree_name_both():
    clip = "actor_rollout_ref.actor.clip_ratio"
    cfg = compose_config("rllm_skyrl.config", f"{clip}=0.1", f"{clip}_low=0.15")
    with pytest.raises(ConfigError) as caught:
        resolve_run_config(cfg, resolve_models=False)
    message = str(caught.value)
    assert "actor_rollout_ref.actor.clip_ratio_low=0.15" in message
    assert "actor_rollout_ref.actor.clip_ratio=0.1" in message and "rllm.algorithm.eps_clip" in message


def test_resolving_leaves_the_config_as_it_was_given():
    cfg = compose_config("rllm_skyrl.config", "data.train_batch_size=8", "trainer.project_name=proj")
    given = OmegaConf.to_container(cfg)
    resolve_run_config(cfg, resolve_models=False)
    aliased = with_aliases(cfg)
    assert OmegaConf.to_container(cfg) == given
    assert aliased.rllm.data.train_batch_size == 8
    assert aliased.rllm.trainer.run_dir == "logs/proj/default"  # interpolations follow the target
    assert OmegaConf.to_container(with_aliases(aliased)) == OmegaConf.to_container(aliased)


def test_the_yaml_declares_every_key_and_nothing_else_at_their_roots():
    cfg = compose_config("rllm_skyrl.config")
    for spec in KEYS:
        assert OmegaConf.select(cfg, spec.key, default="<absent>") != "<absent>", spec.key
    for root in (
        "actor_rollout_ref",
        "critic",
        "algorithm",
        "trainer",
        "rollout",
        "agent",
        "workflow",
        "sampling",
    ):
        declared = {k for k in _leaves(OmegaConf.to_container(cfg[root]), root)}
        assert declared <= {s.key for s in KEYS}, f"{root}: undeclared {declared - {s.key for s in KEYS}}"


def _leaves(tree, prefix):
    if not isinstance(tree, dict):
        return {prefix}
    return {leaf for key, value in tree.items() for leaf in _leaves(value, f"{prefix}.{key}")}


def test_readme_lists_the_table():
    assert table_markdown() in README.read_text()
