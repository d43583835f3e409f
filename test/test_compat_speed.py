"""The CPU speed sets: each gives SkyRL's results (log-probs, gradients, imports, registries, metrics).

Each runs in a fresh interpreter where a patch must not leak into the test process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_python

from rllm_skyrl.compat import registries
from rllm_skyrl.compat import transformers_import_cache as import_cache

# --------------------------------------------------------------------------- transformers' import tables


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

    packages_distributions = import_cache.cached(build)
    first = packages_distributions()
    assert first == built[0] and "torch" in first
    assert list(import_cache.cache_dir().iterdir()) == [
        import_cache.cache_dir() / f"{import_cache.environment_key()}.json"
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

    first = import_cache.cached_structure(define, models)(models, "models")
    second_process = import_cache.cached_structure(define, models)
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
    from rllm_skyrl import compat
    compat.apply(["transformers_import_cache"])
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
    names = compat.for_platform(Platform(cuda=False))
    compat.apply(p for p in names if sys.argv[1] == "lazy" or p != "lazy_imports")
    import skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker  # noqa: F401
    executed = {name: sub in sys.modules for name, sub in
                (("wandb", "wandb.sdk"), ("datasets", "pyarrow"), ("pandas", "pandas.core.frame"))}
    import datasets, pandas, wandb
    used = [callable(wandb.init), datasets.Dataset.from_dict({"a": [1]}).num_rows,
            int(pandas.DataFrame({"a": [2]})["a"].sum())]
    print(json.dumps({"bound": all(n in sys.modules for n in ("wandb", "datasets", "pandas")),
                      "executed": executed, "used": used}))
"""


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
