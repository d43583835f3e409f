"""LoRA as rLLM's tinker users run it: ``model.lora_rank`` and friends, on SkyRL's PEFT workers.

Config tests resolve the composed config only (nothing starts). The integration tests train one
LoRA policy and one fully fine-tuned policy side by side on the tiny model (SkyRL's real workers,
this package's real servers) and compare what trains, what is stored and what moves per sync.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
from helpers import PAIRS, policy_checkpoint_tensors, server_vs_trainer, sft_batch, skyrl_config
from hydra import compose, initialize_config_module
from rllm_harness import (
    DIGITS,
    digit_reward,
    digit_rows,
    requires_rllm,
    rllm_config,
    run_rllm,
    syncs_by_hook,
)
from training_runs import Run, assert_ok, launch, train_env, train_task_ids_by_step, wait

from rllm_skyrl.hardware import Platform
from rllm_skyrl.rollout import weight_sync
from rllm_skyrl.rollout.engine import SkyRLEngine, policy_model_name
from rllm_skyrl.rollout.servers import start_cpu_servers
from rllm_skyrl.run.metrics_file import read_metrics
from rllm_skyrl.run_config import ConfigError, resolve_run_config
from rllm_skyrl.run_config.lora import matched_modules, module_kinds, targets_for
from rllm_skyrl.update.models import ModelRegistry
from rllm_skyrl.update.workers import SkyRLWorkers

CPU = Platform(cuda=False)


def resolve(*overrides: str, platform: Platform = CPU):
    with initialize_config_module("rllm_skyrl.config", version_base=None):
        cfg = compose(
            "unified",
            overrides=[
                "model.path=tiny",
                "rllm.data.max_prompt_length=64",
                "rllm.data.max_response_length=2",
                *overrides,
            ],
        )
    return resolve_run_config(cfg, platform=platform)


# ---------------------------------------------------------------------------- config


def test_the_default_is_full_fine_tuning():
    run = resolve()
    assert not run.lora.enabled and run.skyrl.trainer.policy.model.lora.rank == 0
    assert CPU.weight_sync_method(lora=run.lora.enabled) == "disk" and policy_model_name(run) is None


@pytest.mark.parametrize(
    ("overrides", "kinds"),
    [
        ((), {"attn", "mlp"}),
        (("model.train_mlp=false",), {"attn"}),
        (("model.train_attn=false",), {"mlp"}),
    ],
)
def test_tinker_keys_adapt_exactly_the_attention_and_mlp_layers(tiny_model_dir, overrides, kinds):
    run = resolve("model.lora_rank=8", "model.lora_alpha=32", *overrides)
    lora = run.skyrl.trainer.policy.model.lora
    assert (lora.rank, lora.alpha, run.lora.enabled) == (8, 32, True)
    assert Path(lora.lora_sync_path) == run.sync_dir.resolve() / "lora"  # where the CPU servers may read
    layers = module_kinds(tiny_model_dir)
    adapted = matched_modules(lora.target_modules, list(layers))
    assert {layers[name] for name in adapted} == kinds
    assert sorted(adapted) == sorted(name for name, kind in layers.items() if kind in kinds)


def test_module_kinds_need_only_the_config(tiny_model_dir, tmp_path):
    """The model is read on the meta device: a directory with nothing but config.json is enough."""
    (tmp_path / "config.json").write_text(Path(tiny_model_dir, "config.json").read_text())
    kinds = module_kinds(str(tmp_path))
    assert kinds["lm_head"] == "unembed" and kinds["model.embed_tokens"] == "embed"
    assert kinds["model.layers.1.self_attn.o_proj"] == "attn" and kinds["model.layers.0.mlp.up_proj"] == "mlp"


def test_a_leaf_name_shared_by_frozen_layers_is_targeted_by_full_name():
    """GPT-2 names both projections ``c_proj``: adapting attention only must not touch the MLP's."""
    kinds = {
        "h.0.attn.c_attn": "attn",
        "h.0.attn.c_proj": "attn",
        "h.0.mlp.c_fc": "mlp",
        "h.0.mlp.c_proj": "mlp",
    }
    targets = targets_for(kinds, ["attn"])
    assert targets == ("c_attn", "h.0.attn.c_proj")
    assert matched_modules(targets, list(kinds)) == ["h.0.attn.c_attn", "h.0.attn.c_proj"]


def test_verl_keys_reach_the_lora_settings():
    run = resolve("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8")
    assert (run.lora.rank, run.lora.alpha) == (4, 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model.lora_rank=-1",), "model.lora_rank=-1: must be an integer >= 0"),
        (("model.lora_rank=2.5",), "model.lora_rank=2.5: must be an integer >= 0"),
        (("model.lora_rank=8", "model.lora_alpha=0"), "model.lora_alpha=0: must be a number > 0"),
        (("model.lora_rank=8", "model.lora_dropout=1.0"), "model.lora_dropout=1.0: must be in [0, 1)"),
        (
            ("model.lora_rank=8", "model.lora_target_modules=[q_proj,qkv_proj]"),
            "'qkv_proj' matches no layer of",
        ),
        (("model.lora_rank=8", "model.lora_target_modules=[lm_head]"), "matches the embedding layer(s)"),
        (("model.lora_rank=8", "model.lora_target_modules=.*embed_tokens"), "matches the embedding layer(s)"),
        (("model.lora_rank=8", "model.train_unembed=true"), "model.train_unembed=True (tinker)"),
        (
            ("model.lora_rank=8", "model.train_attn=false", "model.train_mlp=false"),
            "leave LoRA nothing to adapt",
        ),
        (
            ("model.lora_rank=8", "model.train_attn=false", "model.lora_target_modules=[q_proj]"),
            "model.lora_target_modules names the adapted modules itself",
        ),
        (("model.train_mlp=false",), "model.train_mlp=false: model.lora_rank=0 trains every weight"),
        (("model.lora_target_modules=[q_proj]",), "model.lora_rank=0 trains every weight"),
        (
            (
                "model.lora_rank=8",
                "rllm.algorithm.adv_estimator=gae",
                "+skyrl.trainer.critic.model.lora.rank=4",
            ),
            "skyrl.trainer.critic.model.lora.rank=4: LoRA here trains the policy only",
        ),
        (
            ("model.lora_rank=8", "rllm.algorithm.kl_beta=0.1", "+skyrl.trainer.ref.model.lora.rank=4"),
            "skyrl.trainer.ref.model.lora.rank=4: SkyRL's reference worker never reads it",
        ),
        (
            (
                "model.lora_rank=8",
                "model.lora_target_modules=[q_proj]",
                "+skyrl.trainer.policy.model.lora.target_modules=[v_proj]",
            ),
            "and skyrl.trainer.policy.model.lora.target_modules=['v_proj'] set the same thing differently; "
            "set model.lora_target_modules only",
        ),
        (
            ("model.lora_rank=8", "skyrl.trainer.policy.model.lora.lora_sync_path=/tmp/adapters"),
            "this package's CPU servers load adapters only from under the run's sync directory",
        ),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as caught:
        resolve(*overrides)
    assert message in str(caught.value)


def test_lora_policy_with_critic_and_reference_resolves():
    """What SkyRL supports: a LoRA policy next to a fully trained critic, and the base as reference."""
    run = resolve("model.lora_rank=8", "rllm.algorithm.adv_estimator=gae", "rllm.algorithm.kl_beta=0.1")
    assert run.roles == ("policy", "critic", "ref") and run.lora.enabled
    assert run.skyrl.trainer.critic.model.lora.rank == 0


def test_on_gpus_the_lora_policy_takes_skyrls_adapter_sync_and_name():
    """The CUDA path (not runnable here): SkyRL's save_weights_for_sampler, whose LoRA branch writes the
    adapter and has vLLM load it; rollouts name SkyRL's adapter, on SkyRL's own client."""
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import SKYRL_LORA_ADAPTER_NAME

    run = resolve("model.lora_rank=8", platform=Platform.gpu_cluster())
    assert Platform.gpu_cluster().weight_sync_method(lora=run.lora.enabled) == "skyrl"
    assert policy_model_name(run) == SKYRL_LORA_ADAPTER_NAME

    class SkyRLServers:  # what start_skyrl_servers returns: SkyRL's client for its vLLM servers
        client = object()
        urls = ["http://vllm:8000"]

    engine = SkyRLEngine.for_servers(SkyRLServers(), None, run)
    assert engine.client is SkyRLServers.client and engine.model == SKYRL_LORA_ADAPTER_NAME

    calls = []

    class Workers:
        async def save_weights_for_sampler(self):
            calls.append("save_weights_for_sampler")

    shipped = asyncio.run(weight_sync.sync_weights("skyrl", Workers(), None, Path("unused"), 1, "/sync"))
    assert calls == ["save_weights_for_sampler"] and shipped is None


def test_cpu_engine_names_the_adapter_and_refuses_the_base_model(tiny_tokenizer):
    run = resolve("model.lora_rank=8")
    engine = SkyRLEngine.from_urls(
        ["http://127.0.0.1:9"],
        tiny_tokenizer,
        max_prompt_length=8,
        max_response_length=2,
        model=policy_model_name(run),
        uses_lora_weight_sync=run.lora.enabled,
    )
    assert engine.model == "skyrl-lora" and engine.client.uses_lora_weight_sync
    with pytest.raises(ValueError, match="`model` is required when LoRA"):
        asyncio.run(engine.client.generate({"prompt_token_ids": [[1]], "sampling_params": {}}))


def test_merging_is_refused_for_a_fully_trained_model():
    class Workers:
        roles = ("policy",)
        cfg = resolve().skyrl

    models = ModelRegistry(Workers())
    models.create_model("policy")
    with pytest.raises(ValueError, match="no LoRA adapter to merge"):
        models.save_hf_model("policy", "/nowhere", merged_dir="/nowhere/merged")


# ---------------------------------------------------------------------------- real workers and servers

RANK, STEPS, LR = 8, 3, 1e-2


def checkpoint_tensors(workers: SkyRLWorkers, directory: Path) -> tuple[dict, dict]:
    """(model tensors by name, optimizer state by parameter name) from a SkyRL checkpoint."""

    def full(tensor):
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    workers.save_checkpoint("policy", str(directory))
    model = torch.load(directory / "model_world_size_1_rank_0.pt", weights_only=False)
    optim = torch.load(directory / "optim_world_size_1_rank_0.pt", weights_only=False)
    names = list(model)
    (group,) = optim["param_groups"]
    assert group["params"] == list(range(len(names))), "optimizer indices follow the model's parameters"
    state = {
        names[index]: {key: full(value) for key, value in moments.items() if key != "step"}
        for index, moments in optim["state"].items()
    }
    return {name: full(tensor).clone() for name, tensor in model.items()}, state


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for moments in state.values() for t in moments.values())


@pytest.fixture(scope="module")
def trained(ray_cluster, tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    """One LoRA policy and one fully trained policy, the same 3 steps each, each synced to its own
    server (a server holding an adapter refuses full weights until it is unloaded)."""
    root = tmp_path_factory.mktemp("lora")
    targets = list(targets_for(module_kinds(tiny_model_dir), ["attn", "mlp"]))
    lora_sync = root / "lora_sync"
    lora_settings = {
        "trainer.policy.model.lora.rank": RANK,
        "trainer.policy.model.lora.alpha": 2 * RANK,
        "trainer.policy.model.lora.target_modules": targets,
        "trainer.policy.model.lora.lora_sync_path": str(lora_sync),
    }
    lr = {"trainer.policy.optimizer_config.lr": LR}
    lora = SkyRLWorkers(skyrl_config(tiny_model_dir, root / "lora", **lr, **lora_settings), tiny_tokenizer)
    full = SkyRLWorkers(skyrl_config(tiny_model_dir, root / "full", **lr), tiny_tokenizer)
    lora_server = start_cpu_servers(tiny_model_dir, 1, root / "lora_server", weights_root=root)
    full_server = start_cpu_servers(tiny_model_dir, 1, root / "full_server", weights_root=root)
    engine_args = dict(max_prompt_length=64, max_response_length=6)
    lora_engine = SkyRLEngine.from_urls(
        lora_server.urls, tiny_tokenizer, model="skyrl-lora", uses_lora_weight_sync=True, **engine_args
    )
    full_engine = SkyRLEngine.from_urls(full_server.urls, tiny_tokenizer, **engine_args)
    out = {"root": root, "lora": lora, "full": full, "lora_sync": lora_sync, "gaps": {}}
    gaps = out["gaps"]  # (server logprobs, trainer logprobs) of the same sampled tokens
    try:
        out["lora_before"], _ = checkpoint_tensors(lora, root / "lora_ckpt_0")
        sync = weight_sync.sync_weights
        asyncio.run(sync("lora", lora, lora_server, root / "unused", 0, str(lora_sync)))
        gaps["gap_initial"] = server_vs_trainer(lora_engine, lora, tiny_tokenizer)
        batch, *_ = sft_batch(tiny_tokenizer, PAIRS)
        for workers in (lora, full):
            for _ in range(STEPS):
                workers.forward_backward("policy", batch, loss_fn="cross_entropy")
                workers.optim_step("policy")
        gaps["gap_stale"] = server_vs_trainer(lora_engine, lora, tiny_tokenizer)
        started = time.perf_counter()
        out["lora_bytes"] = asyncio.run(sync("lora", lora, lora_server, root / "unused", 1, str(lora_sync)))
        out["lora_seconds"] = time.perf_counter() - started
        started = time.perf_counter()
        out["full_bytes"] = asyncio.run(sync("disk", full, full_server, root / "full_sync", 1))
        out["full_seconds"] = time.perf_counter() - started
        gaps["gap_lora"] = server_vs_trainer(lora_engine, lora, tiny_tokenizer)
        gaps["gap_full"] = server_vs_trainer(full_engine, full, tiny_tokenizer)
        out["lora_after"], out["lora_state"] = checkpoint_tensors(lora, root / "lora_ckpt_3")
        _, out["full_state"] = checkpoint_tensors(full, root / "full_ckpt_3")
        yield out
    finally:
        for engine in (lora_engine, full_engine):
            asyncio.run(engine.close())
        lora_server.stop()
        full_server.stop()
        lora.shutdown()
        full.shutdown()


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@pytest.mark.slow
def test_only_adapters_train_and_only_they_have_optimizer_state(trained):
    before, after = trained["lora_before"], trained["lora_after"]
    adapters = sorted(name for name in after if _is_adapter(name))
    base = [name for name in after if not _is_adapter(name)]
    assert adapters and base and before.keys() == after.keys()
    changed = [name for name in base if not torch.equal(before[name], after[name])]
    assert changed == [], f"base weights moved under LoRA: {changed[:5]}"
    assert all(not torch.equal(before[name], after[name]) for name in adapters if ".lora_B." in name)
    assert sorted(trained["lora_state"]) == adapters  # AdamW moments exist for adapters only
    lora_bytes, full_bytes = state_bytes(trained["lora_state"]), state_bytes(trained["full_state"])
    print(f"\noptimizer state: LoRA rank {RANK} {lora_bytes} B vs full fine-tuning {full_bytes} B")
    assert lora_bytes * 4 < full_bytes


@pytest.mark.slow
def test_sync_ships_the_adapter_and_the_server_samples_from_it(trained):
    from safetensors.torch import load_file

    files = sorted(p.name for p in trained["lora_sync"].iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors"]
    assert all(_is_adapter(k) for k in load_file(trained["lora_sync"] / "adapter_model.safetensors"))
    gaps = {key: (s - t).abs().max().item() for key, (s, t) in trained["gaps"].items()}
    lora_bytes, full_bytes = trained["lora_bytes"], trained["full_bytes"]
    print(
        f"\nbytes per sync: LoRA {lora_bytes} ({trained['lora_seconds']:.2f} s) vs full {full_bytes} "
        f"({trained['full_seconds']:.2f} s); max |server - trainer| logprob: {gaps}"
    )
    assert lora_bytes * 4 < full_bytes
    assert gaps["gap_initial"] < 1e-3 and gaps["gap_lora"] < 1e-3 and gaps["gap_full"] < 1e-3
    assert gaps["gap_stale"] > 1e-2, "training should have moved the policy away from the served adapter"


def _logprobs(model, tokenizer) -> torch.Tensor:
    ids = tokenizer([f"<|im_start|>user\nwhat is {i}?<|im_end|>\n" for i in range(8)], return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids["input_ids"][:, 1:, None]).squeeze(-1)


@pytest.mark.slow
def test_export_writes_the_adapter_and_on_request_a_merged_model(trained, tiny_model_dir, tiny_tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models = ModelRegistry(trained["lora"])
    models.create_model("policy")
    export, merged = trained["root"] / "export", trained["root"] / "merged"
    models.save_hf_model("policy", str(export), merged_dir=str(merged))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in export.iterdir()}
    assert not (export / "model.safetensors").exists()
    assert json.loads((export / "adapter_config.json").read_text())["r"] == RANK

    def base():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    with_adapter = _logprobs(PeftModel.from_pretrained(base(), str(export)).eval(), tiny_tokenizer)
    plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    assert not any("lora" in name for name, _ in plain.named_parameters())
    merged_logprobs = _logprobs(plain, tiny_tokenizer)
    diff = (merged_logprobs - with_adapter).abs().max().item()
    moved = (with_adapter - _logprobs(base(), tiny_tokenizer)).abs().max().item()
    print(f"\nmerged vs base+adapter: max |logprob diff| {diff:.2e} (adapter moved them by {moved:.2e})")
    assert diff < 1e-4 and moved > 1e-2


# ---------------------------------------------------------------------------- checkpoint and resume


# Two LoRA runs and a resume, about a minute; the full-weight resume is in test_checkpoint_resume.py.
@pytest.mark.slow
def test_a_lora_run_resumes_exactly(tmp_path):
    """4 LoRA steps straight, against 2 steps resumed from the straight run's step-2 checkpoint."""
    common = [
        "model.lora_rank=8",
        "training.learning_rate=1e-2",
        "rllm.trainer.total_batches=4",
        "rllm.trainer.save_freq=2",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.val_before_train=false",
    ]
    straight = Run(tmp_path / "straight", tmp_path / "straight.out", tmp_path / "straight.jsonl")
    wait(straight, launch(straight, common, train_env(straight.run_dir)), time.monotonic())
    assert_ok(straight)
    checkpoints = straight.run_dir / "checkpoints"
    assert (checkpoints / "global_step_2" / "policy" / "lora_adapter" / "adapter_config.json").exists()

    resumed = Run(tmp_path / "resumed", tmp_path / "resumed.out", tmp_path / "resumed.jsonl")
    overrides = [
        *common,
        "training.resume_mode=resume_path",
        f"training.resume_from_path={checkpoints / 'global_step_2'}",
    ]
    wait(resumed, launch(resumed, overrides, train_env(resumed.run_dir)), time.monotonic())
    assert_ok(resumed)
    assert "global_step_2 (step 2)" in resumed.text

    expected = train_task_ids_by_step(straight.rollouts())
    assert train_task_ids_by_step(resumed.rollouts()) == {step: expected[step] for step in (3, 4)}
    a = policy_checkpoint_tensors(checkpoints / "global_step_4")
    b = policy_checkpoint_tensors(resumed.run_dir / "checkpoints" / "global_step_4")
    assert a.keys() == b.keys()
    differing = {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    moved = max(
        (a[k] - v).abs().max().item()
        for k, v in policy_checkpoint_tensors(checkpoints / "global_step_2").items()
        if "lora_" in k
    )
    assert not differing, f"resumed state differs from the straight run's: {differing}"
    assert moved > 1e-4, f"the adapters barely trained over steps 3-4 ({moved:.2e})"


# ---------------------------------------------------------------------------- under the real rLLM

# LoRA is for pretrained models: on the random-init tiny model the frozen random embeddings and
# head leave the adapters almost nothing to steer (rank 8 or 32: reward ~0.005 -> ~0.005 in 200 steps).
# The learning test therefore adapts SmolLM2-135M-Instruct, which knows digits but, asked "which
# number is 7?", starts its answer with "7" in ~15% of samples (it prefers "This number...").
LEARNING_LR, LEARNING_STEPS = 1e-3, 10


@pytest.mark.slow
@requires_rllm
def test_tinker_lora_keys_train_under_rllm(ray_cluster, tmp_path):
    """rLLM's config with ``rllm/backend=skyrl`` and tinker's ``model.lora_rank``: every sync ships the
    adapter only, rollouts sample from it, and checkpoints hold it."""
    from rllm.workflows.simple_workflow import SimpleWorkflow

    cfg = rllm_config(
        tmp_path,
        *DIGITS,
        "model.lora_rank=8",
        "model.train_mlp=false",
        "training.group_size=4",
        "data.train_batch_size=4",
        "rllm.trainer.total_batches=3",
        "rllm.trainer.save_freq=3",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.val_before_train=false",
    )
    backend = run_rllm(cfg, SimpleWorkflow, {"reward_function": digit_reward}, digit_rows(32))
    assert syncs_by_hook(backend) == {"": [0], "on_batch_end": [1, 2, 3]}  # the adapter first, then per step
    records = [r for r in read_metrics(tmp_path / "run") if "progress/batch" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    adapter = tmp_path / "ckpt" / "global_step_3" / "policy" / "lora_adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    adapter_bytes = sum(f.stat().st_size for f in (tmp_path / "ckpt" / "sync" / "lora").iterdir())
    for record in records:
        assert record["perf/weight_sync_bytes"] == adapter_bytes
        assert record["train/logprob_abs_diff/max"] < 1e-3


@requires_rllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_lora_policy_learns_to_answer_with_the_number_first(ray_cluster, tmp_path):
    """SmolLM2 with rank-16 adapters on attention and MLP, under rLLM: validation (rLLM's pass@1 on
    32 held-out prompts) before training and after it, reward = the answer starts with the number."""
    from rllm.workflows.simple_workflow import SimpleWorkflow

    cfg = rllm_config(
        tmp_path,
        *DIGITS,
        "model.name=smollm2",
        "model.lora_rank=16",
        "model.lora_alpha=32",
        f"training.learning_rate={LEARNING_LR}",
        "data.max_response_length=2",
        "training.group_size=8",
        "validation.group_size=1",
        "data.train_batch_size=4",
        "data.val_batch_size=32",
        "skyrl.trainer.micro_train_batch_size_per_gpu=32",
        "skyrl.trainer.micro_forward_batch_size_per_gpu=32",
        f"rllm.trainer.total_batches={LEARNING_STEPS}",
        f"rllm.trainer.test_freq={LEARNING_STEPS}",
        "rllm.trainer.val_before_train=true",
    )

    def rows(count: int, seed: int) -> list[dict]:
        return [{**r, "question": f"Which number is {r['answer']}?"} for r in digit_rows(count, seed=seed)]

    run_rllm(cfg, SimpleWorkflow, {"reward_function": digit_reward}, rows(4096, 0), rows(32, 1))
    records = read_metrics(tmp_path / "run")
    val = [r["val/digit_echo/pass@1"] for r in records if "val/digit_echo/pass@1" in r]
    rewards = " ".join(f"{r['reward/mean']:.2f}" for r in records if "reward/mean" in r)
    print(f"\nLoRA rank 16 on SmolLM2: validation pass@1 {val}; training reward per step {rewards}")
    assert len(val) == 2 and val[0] <= 0.3 and val[-1] >= 0.8
