"""Weight sync: trained weights reach the inference server, and the GPU path is SkyRL's transfer."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import PAIRS, hf_state, server_vs_trainer, sft_batch, skyrl_config

from rllm_skyrl.hardware import Platform
from rllm_skyrl.rollout import weight_sync
from rllm_skyrl.rollout.engine import SkyRLEngine
from rllm_skyrl.rollout.servers import start_cpu_servers
from rllm_skyrl.update.workers import SkyRLWorkers

# Server and trainer both run the model in fp32 with the same math, so a token's logprob may
# differ only by float rounding (batched decode with a KV cache vs one full forward).
SAME_POLICY = 1e-4


def test_sync_method_follows_the_device_and_lora():
    assert Platform(cuda=True).weight_sync_method() == "skyrl"
    assert Platform(cuda=True).weight_sync_method(lora=True) == "skyrl"  # SkyRL's own adapter sync
    assert Platform(cuda=False).weight_sync_method() == "disk"
    assert Platform(cuda=False).weight_sync_method(lora=True) == "lora"


def test_cuda_path_calls_skyrls_transfer(tmp_path):
    """On CUDA the backend hands weights to SkyRL's own transfer and never writes to disk."""
    calls = []

    class Workers:
        def connect_inference(self, client):
            calls.append(("connect_inference", client))

        async def save_weights_for_sampler(self):
            calls.append("save_weights_for_sampler")

        def save_hf_model(self, *args):
            raise AssertionError("the CUDA path must not save HF weights")

    method = Platform(cuda=True).weight_sync_method()
    weight_sync.prepare(method, Workers(), "client")
    asyncio.run(weight_sync.sync_weights(method, Workers(), None, tmp_path, version=3))
    assert calls == [("connect_inference", "client"), "save_weights_for_sampler"]
    assert not any(tmp_path.iterdir())
    cpu = Platform(cuda=False).weight_sync_method()
    weight_sync.prepare(cpu, Workers(), "client")  # the disk path needs no connection
    assert calls == [("connect_inference", "client"), "save_weights_for_sampler"]


def test_an_unknown_sync_method_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown weight sync method 'nccl'"):
        asyncio.run(weight_sync.sync_weights("nccl", None, None, tmp_path, version=1))


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_trained_weights_reach_the_server(tied_tiny_model_dir, tiny_tokenizer, tmp_path):
    """On the tied tiny model: the harder case, where trainer and server could disagree on the head."""
    model_dir = tied_tiny_model_dir
    workers = SkyRLWorkers(
        skyrl_config(model_dir, tmp_path, **{"trainer.policy.optimizer_config.lr": 1e-2}), tiny_tokenizer
    )
    servers = start_cpu_servers(model_dir, 1, tmp_path / "servers", weights_root=tmp_path / "sync")
    engine = SkyRLEngine.from_urls(servers.urls, tiny_tokenizer, max_prompt_length=64, max_response_length=6)
    try:
        before, trainer_before = server_vs_trainer(engine, workers, tiny_tokenizer)
        assert (before - trainer_before).abs().max() <= SAME_POLICY
        batch, *_ = sft_batch(tiny_tokenizer, PAIRS)
        for _ in range(3):
            workers.forward_backward("policy", batch, loss_fn="cross_entropy")
            workers.optim_step("policy")
        stale, trainer_now = server_vs_trainer(engine, workers, tiny_tokenizer)
        moved = (stale - trainer_now).abs().max()
        assert moved > 100 * SAME_POLICY, "the update should have moved the policy"
        method = Platform(cuda=False).weight_sync_method()
        asyncio.run(weight_sync.sync_weights(method, workers, servers, tmp_path / "sync", version=1))
        synced, trainer_synced = server_vs_trainer(engine, workers, tiny_tokenizer)
        assert (synced - trainer_synced).abs().max() <= SAME_POLICY
        # The servers read weights only: the tokenizer is neither shipped to the worker nor written.
        assert not list((tmp_path / "sync").glob("tokenizer*"))
        # The trainer kept the tied embeddings tied through training.
        exported = hf_state(str(tmp_path / "sync"))
        embed = exported["model.embed_tokens.weight"]
        assert not torch.equal(embed, hf_state(model_dir)["model.embed_tokens.weight"])
        assert "lm_head.weight" not in exported or torch.equal(exported["lm_head.weight"], embed)
    finally:
        asyncio.run(engine.close())
        servers.stop()
        workers.shutdown()
