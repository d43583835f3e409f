"""The SkyRL patches that apply on CUDA too: the flash-attn stub, re-tied embeddings, response logits.

Each runs in a fresh interpreter, since a patch, once installed, stays for the process.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import pytest
from helpers import run_python

from rllm_skyrl import compat
from rllm_skyrl.compat import (
    flash_attn,
    lazy_imports,
    memory_snapshots,
    package_index,
    registries,
    response_logits,
    single_rank_reductions,
    tied_embeddings,
)
from rllm_skyrl.hardware import Platform


@pytest.mark.parametrize(
    "patch",
    package_index.PATCHES
    + lazy_imports.PATCHES
    + registries.PATCHES
    + flash_attn.PATCHES
    + tied_embeddings.PATCHES
    + response_logits.PATCHES
    + memory_snapshots.PATCHES
    + single_rank_reductions.PATCHES,
    ids=lambda p: p.name,
)
def test_pinned_skyrl_still_needs_patch(patch):
    module_name, attribute, marker = patch.needed_by
    flash_attn.apply()  # SkyRL's worker modules import flash-attn at module level
    target = importlib.import_module(module_name)
    for part in filter(None, attribute.split(".")):
        target = getattr(target, part)
    assert marker in inspect.getsource(target), (
        f"{module_name}{'.' + attribute if attribute else ''} no longer contains {marker!r}: "
        f"SkyRL changed; check whether patch {patch.name!r} is still needed and update or remove it."
    )


# --------------------------------------------------------------------------- flash-attn


@pytest.mark.skipif(flash_attn.available(), reason="flash-attn is installed here: the stub never applies")
def test_skyrl_workers_import_only_with_the_stub():
    program = """
        import json, sys
        def imports():
            try:
                import skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker  # noqa: F401
                return "ok"
            except ImportError as error:
                return f"{type(error).__name__}: {error}"
        bare = imports()
        from rllm_skyrl import compat
        compat.apply(["flash_attn_stub"])
        print(json.dumps({"bare": bare, "stubbed": imports()}))
    """
    outcome = run_python(program)
    assert "flash_attn" in outcome["bare"], outcome
    assert outcome["stubbed"] == "ok"


def test_the_stub_reports_flash_attention_absent():
    program = """
        import json
        from rllm_skyrl.compat import flash_attn
        flash_attn.apply()
        from transformers.utils import is_flash_attn_2_available
        from flash_attn.bert_padding import pad_input
        try:
            pad_input()
            helper = "returned"
        except RuntimeError as error:
            helper = str(error)
        try:
            from flash_attn.ops.triton.cross_entropy import cross_entropy_loss  # noqa: F401
            fused = "importable"
        except ImportError:
            fused = "absent"
        from rllm_skyrl.hardware import Platform
        print(json.dumps({
            "transformers_sees_it": is_flash_attn_2_available(),
            "available": flash_attn.available(),
            "stubbed": flash_attn.is_stubbed(),
            "helper": helper,
            "fused": fused,
            "platform_cuda": Platform(cuda=True, flash_attn=flash_attn.available()).skyrl_overrides(),
        }))
    """
    outcome = run_python(program)
    if not outcome["stubbed"]:
        pytest.skip("flash-attn is installed here: the stub never applies")
    assert outcome["transformers_sees_it"] is False and outcome["available"] is False
    assert "remove_microbatch_padding" in outcome["helper"]
    assert outcome["fused"] == "absent"  # SkyRL keeps its torch cross-entropy
    assert outcome["platform_cuda"] == flash_attn.CONFIG_OVERRIDES


def test_cuda_without_flash_attn_prepares_sdpa_and_keeps_cuda_untouched():
    """The driver of a CUDA run without flash-attn: stub and tie patch, no CPU patch; SkyRL imports."""
    program = """
        import json, torch
        from rllm_skyrl.compat import cpu, flash_attn
        from rllm_skyrl.hardware import Platform
        platform = Platform(cuda=True, flash_attn=False)
        set_device = torch.cuda.set_device
        platform.prepare_process()
        from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import PolicyWorker  # noqa: F401
        from skyrl.backends.skyrl_train.distributed import fsdp_strategy
        print(json.dumps({
            "stubbed": flash_attn.is_stubbed(),
            "cpu_patched": cpu.is_applied() or torch.cuda.set_device is not set_device,
            "retie": getattr(fsdp_strategy.apply_fsdp2, "_rllm_skyrl_patched", False),
        }))
    """
    outcome = run_python(program)
    assert outcome == {"stubbed": not flash_attn.available(), "cpu_patched": False, "retie": True}


def test_memory_snapshots_are_asked_for_only_where_a_worker_records_them():
    program = """
        import json
        from types import SimpleNamespace
        from rllm_skyrl import compat
        compat.apply(["flash_attn_stub", "memory_snapshots"])
        from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch

        calls = []
        class Recorded(Exception):
            pass
        def ask_workers(*args, **kwargs):
            calls.append([*args, *sorted(kwargs.values())])
            raise Recorded()  # SkyRL's own path: it would ray.get the workers' answers next
        groups = {
            "policy": SimpleNamespace(record_memory=False, async_run_ray_method=ask_workers),
            "critic": SimpleNamespace(record_memory=True, async_run_ray_method=ask_workers),
        }
        dispatch = SimpleNamespace(_actor_groups=groups)
        WorkerDispatch._save_memory_snapshot(dispatch, "policy", "optim_step")
        skipped = list(calls)
        try:
            WorkerDispatch._save_memory_snapshot(dispatch, "critic", "optim_step")
        except Recorded:
            pass
        print(json.dumps({"skipped": skipped, "recorded": calls}))
    """
    outcome = run_python(program)
    assert outcome["skipped"] == []
    assert outcome["recorded"] == [["pass_through", "save_memory_snapshot", "critic_optim_step"]]


def test_a_single_rank_reduces_without_a_collective_and_to_the_same_values():
    program = """
        import json, tempfile
        import torch
        import torch.distributed as dist
        from rllm_skyrl import compat
        compat.apply(["flash_attn_stub", "cpu"])  # as in a CPU worker
        from skyrl.backends.skyrl_train.distributed.strategy import DistributedStrategy
        class Strategy:  # SkyRL's method (patched or not, as it is now) on a strategy of world_size ranks
            def __init__(self, world_size):
                self.world_size = world_size
            def all_reduce(self, *args, **kwargs):
                return DistributedStrategy.all_reduce(self, *args, **kwargs)
        rendezvous = tempfile.mktemp()
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
        metrics = {"loss": 0.1, "clip_ratio": 1 / 3, "tokens": 7}
        alone, pair = Strategy(1), Strategy(2)
        skyrl = {op: alone.all_reduce(metrics, op) for op in ("mean", "max", "sum")}
        compat.apply(["single_rank_reductions"])
        collectives = []
        real_all_reduce = dist.all_reduce
        dist.all_reduce = lambda *args, **kwargs: collectives.append(1) or real_all_reduce(*args, **kwargs)
        ours = {op: alone.all_reduce(metrics, op) for op in ("mean", "max", "sum")}
        tensor = torch.tensor([0.25, 0.5])
        same_tensor = alone.all_reduce(tensor, "sum") is tensor
        alone_collectives = len(collectives)
        pair.all_reduce(2.0, "mean")  # two ranks: SkyRL's own path (one rank is up: a world of 1)
        print(json.dumps({"skyrl": skyrl, "ours": ours, "same_tensor": same_tensor,
                          "alone": alone_collectives, "pair": len(collectives) - alone_collectives}))
    """
    outcome = run_python(program)
    assert outcome["ours"] == outcome["skyrl"] and outcome["skyrl"]["mean"]["clip_ratio"] != 1 / 3
    assert outcome["same_tensor"] and outcome["alone"] == 0 and outcome["pair"] == 1


FIRST = ("package_index", "lazy_imports", "registries_in_gcs")
EVERYWHERE = ("tied_embeddings", "response_logits", "memory_snapshots", "single_rank_reductions")


@pytest.mark.parametrize(
    ("platform", "patches"),
    [
        (Platform(cuda=False), (*FIRST, "flash_attn_stub", "cpu", *EVERYWHERE)),
        (Platform(cuda=True, flash_attn=False), (*FIRST, "flash_attn_stub", *EVERYWHERE)),
        (Platform(cuda=True, flash_attn=True), (*FIRST, *EVERYWHERE)),
    ],
    ids=["cpu", "cuda-sdpa", "cuda-flash-attn"],
)
def test_platform_names_the_patches_and_hands_them_to_ray_workers(platform, patches):
    assert platform.compat_patches == patches
    env = platform.ray_runtime_env()
    assert env["worker_process_setup_hook"] == compat.SETUP_HOOK
    assert env["env_vars"] == {compat.ENV_VAR: ",".join(p for p in patches if p != "memory_snapshots")}


def test_worker_hook_applies_what_the_driver_listed():
    program = """
        import json, importlib
        from rllm_skyrl import compat
        module, _, name = compat.SETUP_HOOK.rpartition(".")
        getattr(importlib.import_module(module), name)()  # what Ray does in each worker
        from rllm_skyrl.compat import cpu, flash_attn
        from skyrl.backends.skyrl_train.distributed import fsdp_strategy
        print(json.dumps({
            "stubbed": flash_attn.is_stubbed(),
            "cpu": cpu.is_applied(),
            "retie": getattr(fsdp_strategy.apply_fsdp2, "_rllm_skyrl_patched", False),
        }))
    """
    outcome = run_python(program, env={compat.ENV_VAR: "flash_attn_stub,tied_embeddings"})
    assert outcome == {"stubbed": not flash_attn.available(), "cpu": False, "retie": True}


# --------------------------------------------------------------------------- package index


def test_transformers_package_map_is_built_once_per_environment(tmp_path, monkeypatch):
    """The same map as Python's; read from its file while the environment is unchanged; built anew
    (with the new distribution in it) once one is installed."""
    import importlib.metadata
    import sys

    monkeypatch.setenv("RLLM_SKYRL_CACHE", str(tmp_path / "cache"))
    built: list[dict] = []

    def build() -> dict[str, list[str]]:
        built.append(importlib.metadata.packages_distributions())
        return built[-1]

    packages_distributions = package_index.cached(build)
    first = packages_distributions()
    assert first == built[0] and "torch" in first
    assert list(package_index.cache_dir().iterdir()) == [
        package_index.cache_dir() / f"{package_index.environment_key()}.json"
    ]
    assert packages_distributions() == first and len(built) == 1

    site = tmp_path / "site"
    (site / "newpkg-1.0.dist-info").mkdir(parents=True)
    (site / "newpkg-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: newpkg\nVersion: 1.0\n"
    )
    (site / "newpkg-1.0.dist-info" / "top_level.txt").write_text("newpkg\n")
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    assert packages_distributions()["newpkg"] == ["newpkg"] and len(built) == 2


def test_transformers_model_table_is_built_once_per_environment(tmp_path, monkeypatch):
    """The table read back from its file equals the one built (frozensets and sets included); a
    later process reads it instead of building it; other folders are built as before."""
    import transformers
    from transformers.utils import import_utils

    monkeypatch.setenv("RLLM_SKYRL_CACHE", str(tmp_path / "cache"))
    models = Path(transformers.__file__).parent / "models"
    built: list[tuple] = []

    def define(module_path, prefix=None):
        built.append((str(module_path), prefix))
        return import_utils.define_import_structure(module_path, prefix)

    first = package_index.cached_structure(define, models)(models, "models")
    second_process = package_index.cached_structure(define, models)
    again = second_process(models, "models")
    assert again == first and len(built) == 1 and len(first) > 5
    assert all(isinstance(k, frozenset) for k in again)
    assert all(isinstance(names, set) for modules in again.values() for names in modules.values())
    assert any("models.qwen3.modeling_qwen3" in modules for modules in again.values())
    package = models / "__init__.py"
    assert second_process(package) == import_utils.define_import_structure(package)
    assert len(built) == 2  # the package's own call has a file of its own
    second_process(models / "qwen3")  # one model's folder: not cached
    assert built[-1] == (str(models / "qwen3"), None) and len(built) == 3


MODEL_TABLE = """
    import json, sys
    from rllm_skyrl.compat import package_index
    package_index.apply()
    import transformers
    print(json.dumps({"names": sorted(n for n in dir(transformers) if n.startswith("Zz"))}))
"""


def test_transformers_takes_its_model_table_from_the_file(tmp_path):
    """In a new process the file is what ``from transformers import X`` is resolved from: a name
    written into it is one transformers offers."""
    env = {"RLLM_SKYRL_CACHE": str(tmp_path / "cache")}
    assert run_python(MODEL_TABLE, env=env) == {"names": []}
    files = list((tmp_path / "cache" / "transformers_import_structure").iterdir())
    assert [f.name.split("-", 1)[1] for f in files] == ["models-models.json"]
    rows = json.loads(files[0].read_text())
    rows[0][1]["models.zz_planted.modeling_zz_planted"] = ["ZzPlantedModel"]
    files[0].write_text(json.dumps(rows))
    assert run_python(MODEL_TABLE, env=env) == {"names": ["ZzPlantedModel"]}


# --------------------------------------------------------------------------- lazy imports

LAZY_IMPORTS = """
    import json, sys
    from rllm_skyrl import compat
    from rllm_skyrl.hardware import Platform
    patches = [p for p in Platform.detect().compat_patches if p not in compat.DRIVER_ONLY]
    compat.apply(p for p in patches if sys.argv[1] == "lazy" or p != "lazy_imports")
    import skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker  # noqa: F401
    executed = {name: sub in sys.modules for name, sub in
                (("wandb", "wandb.sdk"), ("datasets", "pyarrow"), ("pandas", "pandas.core.frame"))}
    import datasets, pandas, wandb
    used = [callable(wandb.init), datasets.Dataset.from_dict({"a": [1]}).num_rows,
            int(pandas.DataFrame({"a": [2]})["a"].sum())]
    print(json.dumps({"bound": all(n in sys.modules for n in ("wandb", "datasets", "pandas")),
                      "executed": executed, "used": used}))
"""


def test_a_worker_imports_skyrls_modules_without_running_wandb_datasets_or_pandas():
    """The workers' hook defers the three packages SkyRL's worker modules import and never use
    there; SkyRL still imports them (unpatched, all three run), and each works on first use."""
    lazy, eager = run_python(LAZY_IMPORTS, "lazy"), run_python(LAZY_IMPORTS, "eager")
    assert eager["executed"] == {"wandb": True, "datasets": True, "pandas": True}, eager
    assert lazy["bound"] and lazy["executed"] == {"wandb": False, "datasets": False, "pandas": False}, lazy
    assert lazy["used"] == eager["used"] == [True, 1, 2]


DEFERRED = """
    import inspect, json, os, sys
    sys.path.insert(0, sys.argv[1])
    from rllm_skyrl.compat import lazy_imports
    lazy_imports.LAZY = ("deferred_pkg", "broken_pkg")
    lazy_imports.apply()
    import broken_pkg, deferred_pkg
    inspect.getmodule(json.dumps)  # scans every module's __file__, as torch does on each operator
    after_import = os.environ.get("DEFERRED_RAN")
    import deferred_pkg.sub  # a submodule runs its package first
    after_submodule = os.environ.get("DEFERRED_RAN")
    try:
        broken_pkg.anything
        broken = "ran"
    except RuntimeError as error:
        broken = str(error)
    print(json.dumps({"after_import": after_import, "after_submodule": after_submodule,
                      "value": deferred_pkg.sub.VALUE + deferred_pkg.TOP, "broken": broken,
                      "broken_forgotten": "broken_pkg" not in sys.modules}))
"""


def test_a_deferred_package_runs_on_first_use_as_an_import_would(tmp_path):
    (tmp_path / "deferred_pkg").mkdir()
    init = "import os\nos.environ['DEFERRED_RAN'] = '1'\nTOP = 1\n"
    (tmp_path / "deferred_pkg" / "__init__.py").write_text(init)
    (tmp_path / "deferred_pkg" / "sub.py").write_text("from deferred_pkg import TOP\nVALUE = TOP + 1\n")
    (tmp_path / "broken_pkg").mkdir()
    (tmp_path / "broken_pkg" / "__init__.py").write_text("raise RuntimeError('broken at import')\n")
    outcome = run_python(DEFERRED, str(tmp_path))
    assert outcome == {
        "after_import": None,
        "after_submodule": "1",
        "value": 3,
        "broken": "broken at import",
        "broken_forgotten": True,
    }


# --------------------------------------------------------------------------- function registries


@pytest.mark.usefixtures("ray_cluster")
def test_skyrls_function_registries_live_in_rays_key_value_store():
    """What the driver registers, a Ray worker gets (and the built-ins); no registry actor runs,
    and what is unregistered is gone from the store."""
    import ray
    from ray.experimental import internal_kv
    from skyrl.backends.skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry, PolicyLossRegistry

    def stored() -> set[bytes]:
        return set(internal_kv._internal_kv_list("policy_loss_registry/", namespace=registries.NAMESPACE))

    def probe_loss(*args, **kwargs):
        return "probe"

    @ray.remote(num_cpus=0)
    def lookup() -> tuple[str, list[str]]:
        from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

        return PolicyLossRegistry.get("probe_loss")(), PolicyLossRegistry.list_available()

    PolicyLossRegistry.register("probe_loss", probe_loss)
    try:
        assert b"policy_loss_registry/probe_loss" in stored()
        result, available = ray.get(lookup.remote())
        assert result == "probe" and {"regular", "cross_entropy", "probe_loss"} <= set(available)
    finally:
        PolicyLossRegistry.unregister("probe_loss")
    assert b"policy_loss_registry/probe_loss" not in stored()
    assert b"policy_loss_registry/regular" in stored()
    for registry in (PolicyLossRegistry, AdvantageEstimatorRegistry):
        with pytest.raises(ValueError):
            ray.get_actor(registry._actor_name)


def test_unknown_patch_set_is_refused():
    with pytest.raises(ValueError, match="unknown SkyRL patch set.*'fast_mode'"):
        compat.apply(["fast_mode"])


# --------------------------------------------------------------------------- tied embeddings

FSDP_INIT = """
    import json, socket, sys, torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from rllm_skyrl import compat
    patches = ["flash_attn_stub", "cpu"] + (["tied_embeddings"] if sys.argv[2] == "patched" else [])
    compat.apply(patches)
    from skyrl.backends.skyrl_train.distributed.fsdp_strategy import FSDPStrategy
    from rllm_skyrl.run_config import make_skyrl_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    policy = make_skyrl_config({"trainer.policy.fsdp_config.mixed_precision": fp32,
                                "trainer.policy.optimizer_config.lr": 1e-2}).trainer.policy
    strategy = FSDPStrategy(policy.fsdp_config, policy.optimizer_config, policy.model)
    strategy.setup_distributed()
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    tied_at_load = model.lm_head.weight is model.model.embed_tokens.weight
    model, optimizer, scheduler = strategy.prepare((model, None, None))
    ids = torch.arange(1, 17).reshape(2, 8)
    for _ in range(3):
        logits = model(ids).logits[:, :-1].flatten(0, 1)
        loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:].flatten())
        loss.backward()
        strategy.optimizer_step(optimizer, model, scheduler)
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    print(json.dumps({
        "tied_at_load": tied_at_load,
        "shared": model.lm_head.weight is model.model.embed_tokens.weight,
        "equal_after_steps": torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]),
        "optimizer_tensors": sum(len(group["params"]) for group in optimizer.param_groups),
        "model_parameters": len(list(model.parameters())),
    }))
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("mode", ["unpatched", "patched"])
def test_skyrl_fsdp_init_keeps_tied_embeddings_tied_only_with_the_patch(tied_tiny_model_dir, mode):
    """SkyRL's own FSDP2 set-up and optimizer step, single rank: unpatched it unties the head."""
    outcome = run_python(FSDP_INIT, tied_tiny_model_dir, mode)
    assert outcome["tied_at_load"] is True
    if mode == "unpatched":
        assert outcome["shared"] is False and outcome["equal_after_steps"] is False, outcome
    else:
        assert outcome["shared"] is True and outcome["equal_after_steps"] is True, outcome
        assert outcome["optimizer_tensors"] == outcome["model_parameters"]


def test_retie_restores_what_transformers_tied_and_nothing_else(tied_tiny_model_dir, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tied_tiny_model_dir, dtype=torch.float32)
    model.to(torch.device("meta"))
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # what SkyRL's meta move does
    tied_embeddings.retie(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight

    untied = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    tied_embeddings.retie(untied)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


# --------------------------------------------------------------------------- response logits

WINDOW_FORWARD = """
    import json, sys, torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from rllm_skyrl import compat
    compat.apply(["flash_attn_stub"])
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper
    original = HFModelWrapper.forward
    compat.apply(["response_logits"])

    torch.manual_seed(0)
    # 4 rows: prompts left-padded to 9, responses right-padded to 5 (lengths 5, 3, 5, 1)
    prompt_lens, response_lens, num_actions = [9, 6, 4, 9], [5, 3, 5, 1], 5
    mask = torch.zeros(4, 14, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, 9 - p : 9 + r] = 1
    sequences = torch.randint(3, 250, (4, 14)) * mask
    advantages = torch.randn(4, 1)

    def run(wrapper, forward):
        positions = []
        head = wrapper.model.get_output_embeddings()
        hook = head.register_forward_hook(lambda m, args, out: positions.append(args[0].shape[1]))
        wrapper.model.zero_grad(set_to_none=True)
        logprobs, output = forward(wrapper, sequences, num_actions, attention_mask=mask, temperature=0.7,
                                   return_output=True, compute_entropy=True, entropy_requires_grad=True)
        hook.remove()
        entropy = output["entropy"][:, -num_actions - 1 : -1]  # what SkyRL's worker reads
        loss_mask = mask[:, -num_actions:].float()
        loss = -(advantages * logprobs * loss_mask).sum() + 0.1 * (entropy * loss_mask).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in wrapper.model.named_parameters() if p.grad is not None}
        return logprobs.detach(), entropy.detach(), output["entropy"].shape, grads, positions

    def compare(wrapper):
        patched, unpatched = run(wrapper, HFModelWrapper.forward), run(wrapper, original)
        return {
            "logprobs_equal": torch.equal(patched[0], unpatched[0]),
            "entropy_gap": (patched[1] - unpatched[1]).abs().max().item(),
            "entropy_shape": list(patched[2]) == list(unpatched[2]),
            "grad_names_equal": sorted(patched[3]) == sorted(unpatched[3]),
            "grad_gap": max(((patched[3][n] - unpatched[3][n]).abs().max()
                             / unpatched[3][n].abs().max()).item() for n in patched[3]),
            "head_positions": [patched[4], unpatched[4]],
        }

    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    full = HFModelWrapper(model, use_flash_attention_2=False, bf16=False)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    adapter = HFModelWrapper(lora, use_flash_attention_2=False, bf16=False)
    fallback = HFModelWrapper(AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32),
                              use_flash_attention_2=False, bf16=False)
    fallback._rllm_skyrl_logits_to_keep = False  # a model whose forward cannot skip positions
    print(json.dumps({"full": compare(full), "lora": compare(adapter), "fallback": compare(fallback)}))
"""


def test_response_logits_match_skyrl_forward_and_skip_the_prompt(tiny_model_dir):
    """The patched forward equals SkyRL's on what its worker reads, with the LM head on the window only."""
    outcome = run_python(WINDOW_FORWARD, tiny_model_dir)
    for case in ("full", "lora", "fallback"):
        result = outcome[case]
        assert result["logprobs_equal"], (case, result)
        assert result["entropy_gap"] < 1e-6 and result["entropy_shape"], (case, result)
        assert result["grad_names_equal"] and result["grad_gap"] < 1e-6, (case, result)
    assert outcome["full"]["head_positions"] == [[6], [14]]  # num_actions + 1 positions, not all 14
    assert outcome["lora"]["head_positions"] == [[6], [14]]
    assert outcome["fallback"]["head_positions"] == [[14], [14]]


PACKED_FORWARD = """
    import json, sys, torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    sys.path.insert(0, sys.argv[2])
    from test_context_packing import GROUPS, grpo_batch
    from rllm_skyrl import compat
    compat.apply(["flash_attn_stub"])
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper
    original = HFModelWrapper.forward
    compat.apply(["response_logits"])

    sequences, mask, _ = grpo_batch(GROUPS, num_actions=3)
    advantages = torch.randn(len(sequences), 1, generator=torch.Generator().manual_seed(2))

    def run(wrapper, forward):
        rows = []
        head = wrapper.model.get_output_embeddings()
        hook = head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
        wrapper.model.zero_grad(set_to_none=True)
        logprobs, output = forward(wrapper, sequences, 3, attention_mask=mask, temperature=0.7,
                                   return_output=True, compute_entropy=True, entropy_requires_grad=True)
        hook.remove()
        entropy = output["entropy"][:, -4:-1]
        loss_mask = mask[:, -3:].float()
        (-(advantages * logprobs * loss_mask).sum() + 0.1 * (entropy * loss_mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in wrapper.model.named_parameters() if p.grad is not None}
        return logprobs.detach(), entropy.detach(), grads, rows

    def compare(wrapper):
        packed, unpatched = run(wrapper, HFModelWrapper.forward), run(wrapper, original)
        return {
            "logprob_gap": (packed[0] - unpatched[0]).abs().max().item(),
            "entropy_gap": (packed[1] - unpatched[1]).abs().max().item(),
            "grad_names_equal": sorted(packed[2]) == sorted(unpatched[2]),
            "grad_gap": max(((packed[2][n] - unpatched[2][n]).abs().max()
                             / unpatched[2][n].abs().max()).item() for n in packed[2]),
            "head_rows": [packed[3], unpatched[3]],
        }

    load = lambda: AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32,
                                                        attn_implementation="sdpa")
    full = HFModelWrapper(load(), use_flash_attention_2=False, bf16=False)
    lora = HFModelWrapper(get_peft_model(load(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           init_lora_weights=False)),
                          use_flash_attention_2=False, bf16=False)
    print(json.dumps({"full": compare(full), "lora": compare(lora)}))
"""


def test_a_prompts_samples_are_computed_as_one_packed_row_with_skyrl_forwards_results(tiny_model_dir):
    """Through the patched ``HFModelWrapper.forward``: a GRPO batch (3 prompts x 4 samples) runs
    the model on 4 packed rows instead of 12, with SkyRL's log-probs, entropy and gradients."""
    from pathlib import Path

    outcome = run_python(PACKED_FORWARD, tiny_model_dir, str(Path(__file__).parent))
    for case in ("full", "lora"):
        result = outcome[case]
        assert result["logprob_gap"] < 1e-5 and result["entropy_gap"] < 1e-5, (case, result)
        assert result["grad_names_equal"] and result["grad_gap"] < 1e-5, (case, result)
        assert result["head_rows"] == [[4], [12]], (case, result)
