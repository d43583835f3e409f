"""The patch sets that apply on CUDA too, each a bug fix: reproduced on unpatched SkyRL, gone with the set.

``flash_attn_stub``: SkyRL's worker modules cannot be imported without flash-attn (upstream: import
``flash_attn.bert_padding`` where ``remove_microbatch_padding`` uses it). ``tied_embeddings``:
SkyRL's FSDP set-up trains ``lm_head`` apart from the embeddings it is tied to (upstream: re-tie
after the meta move and after loading the state dict). Each runs in a fresh interpreter, since a
patch, once installed, stays for the process.
"""

from __future__ import annotations

import pytest
from helpers import run_python

from rllm_skyrl.compat import tied_embeddings
from rllm_skyrl.hardware import NO_FLASH_ATTN_CONFIG, flash_attn_installed

# --------------------------------------------------------------------------- flash-attn


@pytest.mark.slow
@pytest.mark.skipif(flash_attn_installed(), reason="flash-attn is installed here: the stub never applies")
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
        from rllm_skyrl.hardware import Platform, flash_attn_installed
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
        print(json.dumps({
            "transformers_sees_it": is_flash_attn_2_available(),
            "available": flash_attn_installed(),
            "stubbed": flash_attn.is_stubbed(),
            "helper": helper,
            "fused": fused,
            "platform_cuda": Platform(cuda=True, flash_attn=flash_attn_installed()).skyrl_overrides(),
        }))
    """
    outcome = run_python(program)
    if not outcome["stubbed"]:
        pytest.skip("flash-attn is installed here: the stub never applies")
    assert outcome["transformers_sees_it"] is False and outcome["available"] is False
    assert "remove_microbatch_padding" in outcome["helper"]
    assert outcome["fused"] == "absent"  # SkyRL keeps its torch cross-entropy
    assert outcome["platform_cuda"] == NO_FLASH_ATTN_CONFIG


@pytest.mark.slow
def test_cuda_without_flash_attn_prepares_sdpa_and_keeps_cuda_untouched():
    """The driver of a CUDA run without flash-attn: stub and tie patch, no CPU patch; SkyRL imports."""
    program = """
        import json, torch
        from rllm_skyrl import compat
        from rllm_skyrl.compat import cpu, flash_attn
        from rllm_skyrl.hardware import Platform
        platform = Platform(cuda=True, flash_attn=False)
        set_device = torch.cuda.set_device
        applied = compat.prepare_driver(platform)
        from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import PolicyWorker  # noqa: F401
        from skyrl.backends.skyrl_train.distributed import fsdp_strategy
        print(json.dumps({
            "stubbed": flash_attn.is_stubbed(),
            "cpu_patched": cpu.is_applied() or torch.cuda.set_device is not set_device,
            "retie": getattr(fsdp_strategy.apply_fsdp2, "_rllm_skyrl_patched", False),
            "applied": applied,
        }))
    """
    outcome = run_python(program)
    stub = [] if flash_attn_installed() else ["flash_attn_stub"]
    assert outcome == {
        "stubbed": not flash_attn_installed(),
        "cpu_patched": False,
        "retie": True,
        "applied": [*stub, "tied_embeddings"],
    }


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


@pytest.mark.slow
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
