"""Weight sync: trained weights reach the inference server, and the GPU path is chosen on CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_workers_cpu import PAIRS, config, sft_batch

from rllm_skyrl import weight_sync
from rllm_skyrl.engine import SkyRLEngine
from rllm_skyrl.platform import Platform
from rllm_skyrl.servers import start_cpu_servers
from rllm_skyrl.workers import SkyRLWorkers


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


def _server_vs_trainer(engine: SkyRLEngine, workers: SkyRLWorkers, tokenizer):
    """Sample 8 completions; return (server logprobs, trainer logprobs) of the same tokens."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

    async def sample():
        messages = [[{"role": "user", "content": f"what is {i}?"}] for i in range(8)]
        return await asyncio.gather(*(engine.get_model_response(m, seed=i) for i, m in enumerate(messages)))

    outputs = asyncio.run(sample())
    prompts = [o.prompt_ids for o in outputs]
    responses = [o.completion_ids for o in outputs]
    sequences, attention, response_mask, _, loss_mask, *_ = convert_prompts_responses_to_batch_tensors(
        tokenizer.pad_token_id,
        prompts,
        responses,
        [[0.0] * len(r) for r in responses],
        [[1] * len(r) for r in responses],
    )
    batch = TrainingInputBatch(
        {
            "sequences": sequences,
            "attention_mask": attention,
            "response_mask": response_mask,
            "loss_mask": loss_mask.float(),
        }
    )
    batch.metadata = {"response_length": response_mask.shape[1]}
    trained = workers.forward("policy", batch, loss_fn="cross_entropy").loss_fn_outputs
    server = torch.cat([torch.tensor(o.logprobs) for o in outputs])
    trainer = torch.cat([torch.tensor(t["logprobs"]) for t in trained])
    return server, trainer


@pytest.mark.usefixtures("ray_cluster")
def test_trained_weights_reach_the_server(tiny_model_dir, tiny_tokenizer, tmp_path):
    workers = SkyRLWorkers(
        config(tiny_model_dir, tmp_path, **{"trainer.policy.optimizer_config.lr": 1e-2}), tiny_tokenizer
    )
    servers = start_cpu_servers(tiny_model_dir, 1, tmp_path / "servers")
    engine = SkyRLEngine.from_urls(servers.urls, tiny_tokenizer, max_prompt_length=64, max_response_length=6)
    try:
        before, trainer_before = _server_vs_trainer(engine, workers, tiny_tokenizer)
        assert (before - trainer_before).abs().mean() < 1e-3
        batch, *_ = sft_batch(tiny_tokenizer, PAIRS)
        for _ in range(3):
            workers.forward_backward("policy", batch, loss_fn="cross_entropy")
            workers.optim_step("policy")
        stale, trainer_now = _server_vs_trainer(engine, workers, tiny_tokenizer)
        assert (stale - trainer_now).abs().mean() > 1e-2, "the update should have moved the policy"
        method = Platform.detect().weight_sync_method()
        assert method == "disk"
        asyncio.run(weight_sync.sync_weights(method, workers, servers, tmp_path / "sync", version=1))
        synced, trainer_synced = _server_vs_trainer(engine, workers, tiny_tokenizer)
        assert (synced - trainer_synced).abs().mean() < 1e-3
    finally:
        asyncio.run(engine.close())
        servers.stop()
        workers.shutdown()
