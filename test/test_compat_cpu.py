"""The ``cpu`` set: each patch is needed on this machine and works, in the driver and in Ray workers.

The bug fixes that apply on CUDA too are in ``test_compat_bugs.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rllm_skyrl import compat
from rllm_skyrl.compat import cpu
from rllm_skyrl.hardware import Platform

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches are inert on CUDA machines")


UNPATCHED_PROBES = {
    "cuda_set_device_noop": "torch.cuda.set_device(0)",
    "cuda_current_device_cpu": "torch.cuda.current_device()",
    "cuda_synchronize_noop": "torch.cuda.synchronize()",
    "tensor_cuda_identity": "torch.zeros(1).cuda()",
    "empty_on_cpu": "torch.empty(2, device='cuda')",
    "cpu_device_mesh": "from torch.distributed.device_mesh import init_device_mesh; "
    "import torch.distributed as d; d.init_process_group('gloo', rank=0, world_size=1, "
    "init_method='tcp://127.0.0.1:0'); from torch.distributed.fsdp import fully_shard; "
    "fully_shard(torch.nn.Linear(2, 2), mesh=init_device_mesh('cuda', (1,)))",
    "gloo_process_group": "import torch.distributed as d; d.init_process_group('cpu:gloo,cuda:nccl', rank=0, "
    "world_size=1, init_method='tcp://127.0.0.1:0'); d.all_reduce(torch.zeros(1))",
}


def test_every_patch_has_an_unpatched_probe():
    assert set(UNPATCHED_PROBES) == {p.name for p in cpu.PATCHES}


PROBE_RUNNER = """
import json, sys, torch
import torch.distributed as dist
from rllm_skyrl.compat import flash_attn
flash_attn.apply()  # not under test here: SkyRL's worker modules need it to import at all
if sys.argv[1] == "patched":
    from rllm_skyrl.compat import cpu
    cpu.apply()
outcome = {}
for name, code in json.loads(sys.argv[2]).items():
    try:
        exec(code, {"torch": torch})
        outcome[name] = "ok"
    except Exception as error:
        outcome[name] = f"{type(error).__name__}: {error}"[:300]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
print(json.dumps(outcome))
"""


def run_probes(mode: str) -> dict[str, str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE_RUNNER, mode, json.dumps(UNPATCHED_PROBES)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_unpatched_calls_fail_and_patched_calls_work():
    """Without each patch SkyRL's call fails on this machine; with it, the same call succeeds."""
    bare, patched = run_probes("bare"), run_probes("patched")
    obsolete = [name for name, outcome in bare.items() if outcome == "ok"]
    assert not obsolete, f"these calls now work unpatched; the patches may be obsolete: {obsolete}"
    broken = {name: outcome for name, outcome in patched.items() if outcome != "ok"}
    assert not broken, f"still failing with the patches applied: {broken}"


def test_apply_is_a_noop_when_cuda_is_available(monkeypatch):
    installed = []
    fake = cpu.Patch("probe", ("", "", ""), lambda: installed.append(1))
    monkeypatch.setattr(cpu, "PATCHES", (fake,))
    monkeypatch.setattr(cpu, "_applied", False)
    monkeypatch.setattr(cpu.torch.cuda, "is_available", lambda: True)
    cpu.apply()
    assert installed == [] and not cpu.is_applied()
    assert "cpu" not in compat.for_platform(Platform(cuda=True))


def test_cpu_config_overrides_win():
    from rllm_skyrl.run_config import make_skyrl_config

    cfg = make_skyrl_config({"trainer.flash_attn": True, "trainer.placement.colocate_all": True})
    assert cfg.trainer.flash_attn is False
    assert cfg.trainer.remove_microbatch_padding is False
    assert cfg.trainer.placement.colocate_all is False
    assert cfg.data.dataloader.num_workers == 0


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_patches_are_applied_inside_ray_workers():
    import ray

    @ray.remote(num_gpus=1)
    def probe():
        import torch as t
        from skyrl.backends.skyrl_train.distributed.strategy import DistributedStrategy
        from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper

        from rllm_skyrl.compat import cpu as worker_cpu

        return {
            "hook": os.environ.get(compat.ENV_VAR),
            "applied": worker_cpu.is_applied(),
            "response_logits": getattr(HFModelWrapper.forward, "_rllm_skyrl_patched", False),
            "skyrls_all_reduce": not getattr(DistributedStrategy.all_reduce, "_rllm_skyrl_patched", False),
            "device": str(t.cuda.current_device()),
            "flash_attn": "flash_attn" in sys.modules,
            "gpu_ids": ray.get_gpu_ids(),
            "niceness": os.nice(0),
        }

    result = ray.get(probe.remote())
    assert result["hook"] == ",".join(compat.for_platform(Platform(cuda=False)))
    assert result["applied"] and result["response_logits"] and result["skyrls_all_reduce"]
    assert result["device"] == "cpu" and result["flash_attn"]
    assert len(result["gpu_ids"]) == 1  # logical GPUs gate scheduling like real ones
    assert result["niceness"] == os.nice(0)  # the training workers run at the driver's priority
