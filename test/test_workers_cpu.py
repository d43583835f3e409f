"""SkyRL's real FSDP workers on CPU through Ray, driven through our facade."""

from __future__ import annotations

import pytest
import torch

from rllm_skyrl.run_config import make_skyrl_config
from rllm_skyrl.workers import SkyRLWorkers

pytestmark = pytest.mark.usefixtures("ray_cluster")

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def config(model_dir: str, tmp_path, **overrides):
    base = {
        "trainer.policy.model.path": model_dir,
        "trainer.policy.fsdp_config.mixed_precision": FP32,
        "trainer.policy.optimizer_config.lr": 1e-3,
        "trainer.policy.optimizer_config.weight_decay": 0.0,
        "trainer.gradient_checkpointing": False,
        "trainer.micro_train_batch_size_per_gpu": 8,
        "trainer.micro_forward_batch_size_per_gpu": 8,
        "trainer.algorithm.use_kl_loss": False,
        "generator.sampling_params.temperature": 1.0,
        "trainer.ckpt_path": str(tmp_path / "ckpt"),
        "trainer.export_path": str(tmp_path / "export"),
        "trainer.log_path": str(tmp_path / "logs"),
    }
    base.update(overrides)
    return make_skyrl_config(base)


def sft_batch(tokenizer, pairs: list[tuple[str, str]]):
    """Prompt/response pairs -> TrainingInputBatch, built by SkyRL's own preprocessing."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

    prompts = [tokenizer(p)["input_ids"] for p, _ in pairs]
    responses = [tokenizer(r)["input_ids"] + [tokenizer.eos_token_id] for _, r in pairs]
    sequences, attention_mask, response_mask, _rewards, loss_mask, *_ = (
        convert_prompts_responses_to_batch_tensors(
            tokenizer.pad_token_id,
            prompts,
            responses,
            rewards=[[0.0] * len(r) for r in responses],
            loss_masks=[[1] * len(r) for r in responses],
        )
    )
    batch = TrainingInputBatch(
        {
            "sequences": sequences,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "loss_mask": loss_mask.float(),
        }
    )
    batch.metadata = {"response_length": response_mask.shape[1]}
    return batch, prompts, responses


PAIRS = [("what is 3?", " 3"), ("what is 12?", "1 2 3"), ("what is 7 plus 2?", " 9"), ("what is 5?", "5")]


@pytest.fixture(scope="module")
def policy(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    workers = SkyRLWorkers(config(tiny_model_dir, tmp_path_factory.mktemp("policy")), tiny_tokenizer)
    yield workers
    workers.shutdown()


def test_batch_layout_is_skyrls(tiny_tokenizer):
    batch, prompts, responses = sft_batch(tiny_tokenizer, PAIRS)
    width = batch["response_mask"].shape[1]
    assert width == max(len(r) for r in responses)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        row = batch["sequences"][i]
        n = len(p) + len(r)
        # Left padding: real tokens are the last n positions, response right-aligned.
        assert row[-n:].tolist() == p + r
        assert batch["attention_mask"][i].sum().item() == n
        assert batch["response_mask"][i, width - len(r) :].tolist() == [1] * len(r)
        assert batch["response_mask"][i, : width - len(r)].sum().item() == 0


def hf_logprobs(model_dir: str, prompts, responses) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses, strict=True):
            ids = torch.tensor([p + r])
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            targets = ids[0, len(p) :]
            out.append(logp[len(p) - 1 : -1].gather(-1, targets[:, None]).squeeze(-1))
    return out


def test_cross_entropy_outputs_match_plain_hf_forward(policy, tiny_model_dir, tiny_tokenizer):
    batch, prompts, responses = sft_batch(tiny_tokenizer, PAIRS)
    out = policy.forward("policy", batch, loss_fn="cross_entropy")
    expected = hf_logprobs(tiny_model_dir, prompts, responses)
    assert len(out.loss_fn_outputs) == len(PAIRS)
    for got, want in zip(out.loss_fn_outputs, expected, strict=True):
        logprobs = torch.tensor(got["logprobs"])
        assert logprobs.shape == want.shape
        torch.testing.assert_close(logprobs, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(got["elementwise_loss"]), -want, atol=1e-4, rtol=0)
    # The scalar loss is the masked sum of the per-token losses (SkyRL's losses return sums).
    total = sum(float(-w.sum()) for w in expected)
    assert out.metrics["loss"] == pytest.approx(total, rel=1e-4)


def test_repeated_cross_entropy_steps_halve_the_loss(tiny_model_dir, tiny_tokenizer, tmp_path):
    workers = SkyRLWorkers(config(tiny_model_dir, tmp_path), tiny_tokenizer)
    try:
        batch, *_ = sft_batch(tiny_tokenizer, PAIRS)
        losses = []
        for _ in range(30):
            losses.append(workers.forward_backward("policy", batch, loss_fn="cross_entropy").metrics["loss"])
            grad_norm = workers.optim_step("policy")
            assert grad_norm is not None and grad_norm > 0
        assert losses[-1] <= 0.5 * losses[0], losses
    finally:
        workers.shutdown()


def _weights_after(workers: SkyRLWorkers, export_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    workers.save_hf_model("policy", str(export_dir))
    return load_file(str(export_dir / "model.safetensors"))


def test_gradient_accumulation_equals_one_big_batch(tiny_model_dir, tiny_tokenizer, tmp_path):
    """Two forward_backward calls then one optim_step == one call on the concatenated batch."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    full, *_ = sft_batch(tiny_tokenizer, PAIRS)
    first, second = full.slice(0, 2), full.slice(2, 4)

    accumulated = SkyRLWorkers(config(tiny_model_dir, tmp_path / "a"), tiny_tokenizer)
    try:
        accumulated.forward_backward("policy", first, loss_fn="cross_entropy")
        accumulated.forward_backward("policy", second, loss_fn="cross_entropy")
        norm_accumulated = accumulated.optim_step("policy")
        w_accumulated = _weights_after(accumulated, tmp_path / "a_out")
    finally:
        accumulated.shutdown()

    single = SkyRLWorkers(config(tiny_model_dir, tmp_path / "b"), tiny_tokenizer)
    try:
        single.forward_backward("policy", TrainingInputBatch.cat([first, second]), loss_fn="cross_entropy")
        norm_single = single.optim_step("policy")
        w_single = _weights_after(single, tmp_path / "b_out")
    finally:
        single.shutdown()

    assert norm_accumulated == pytest.approx(norm_single, rel=1e-4)
    base = hf_state(tiny_model_dir)
    moved = 0
    for name, tensor in w_single.items():
        torch.testing.assert_close(w_accumulated[name], tensor, atol=1e-6, rtol=1e-5)
        if name in base:  # tied embeddings may be exported under both names
            moved += int(not torch.equal(tensor, base[name]))
    assert moved > 0, "the optimizer step changed no weight"


def hf_state(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def test_two_fsdp_ranks_over_gloo(tiny_model_dir, tiny_tokenizer, tmp_path):
    """World size 2: the batch is split over two gloo ranks and the result equals one rank's."""
    cfg = config(tiny_model_dir, tmp_path, **{"trainer.placement.policy_num_gpus_per_node": 2})
    workers = SkyRLWorkers(cfg, tiny_tokenizer)
    try:
        assert workers.dp_size() == 2
        batch, prompts, responses = sft_batch(tiny_tokenizer, PAIRS)
        out = workers.forward_backward("policy", batch, loss_fn="cross_entropy")
        expected = hf_logprobs(tiny_model_dir, prompts, responses)
        for got, want in zip(out.loss_fn_outputs, expected, strict=True):
            torch.testing.assert_close(torch.tensor(got["logprobs"]), want, atol=1e-4, rtol=0)
        assert workers.optim_step("policy") > 0
    finally:
        workers.shutdown()
