"""SkyRL's real FSDP workers on CPU through Ray, driven through our facade.

Cross-entropy outputs against a plain HF forward and gradient accumulation are checked through
the model registry (``test_models.py``); here: the batch layout, data parallelism over gloo, and
that repeated steps train.
"""

from __future__ import annotations

import pytest
import torch
from helpers import PAIRS, exported_weights, hf_logprobs, hf_state, sft_batch, skyrl_config

from rllm_skyrl.update.workers import SkyRLWorkers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def policy(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    """One rank; ``rewind(policy)`` puts it back to its starting weights and optimizer state."""
    root = tmp_path_factory.mktemp("policy")
    cfg = skyrl_config(tiny_model_dir, root)
    workers = SkyRLWorkers(cfg, tiny_tokenizer)
    workers.start_dir = root / "start"
    workers.save_checkpoint("policy", str(workers.start_dir))
    yield workers
    workers.shutdown()


def rewind(workers: SkyRLWorkers) -> None:
    workers.optim_step("policy")  # drops gradients a failed test may have left accumulated
    workers.load_checkpoint("policy", str(workers.start_dir))


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


def test_two_fsdp_ranks_over_gloo_equal_one_rank(policy, tiny_model_dir, tiny_tokenizer, tmp_path):
    """World size 2: each rank gets half the batch; logprobs, grad norm and the updated weights
    equal one rank's on the whole batch (a broken all-reduce would leave each rank its own half)."""
    batch, prompts, responses = sft_batch(tiny_tokenizer, PAIRS)
    rewind(policy)
    one_rank_out = policy.forward_backward("policy", batch, loss_fn="cross_entropy")
    one_rank_norm = policy.optim_step("policy")
    one_rank = exported_weights(policy, "policy", tmp_path / "one")

    cfg = skyrl_config(tiny_model_dir, tmp_path, **{"trainer.placement.policy_num_gpus_per_node": 2})
    workers = SkyRLWorkers(cfg, tiny_tokenizer)
    try:
        assert workers.dp_size() == 2
        out = workers.forward_backward("policy", batch, loss_fn="cross_entropy")
        two_rank_norm = workers.optim_step("policy")
        two_ranks = exported_weights(workers, "policy", tmp_path / "two")
    finally:
        workers.shutdown()

    expected = hf_logprobs(tiny_model_dir, prompts, responses)
    for got, want in zip(out.loss_fn_outputs, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got["logprobs"]), want, atol=1e-4, rtol=0)
    assert out.metrics["loss"] == pytest.approx(one_rank_out.metrics["loss"], rel=1e-5)
    assert two_rank_norm == pytest.approx(one_rank_norm, rel=1e-5, abs=1e-7)
    base = hf_state(tiny_model_dir)
    moved = 0
    for name, tensor in one_rank.items():
        torch.testing.assert_close(two_ranks[name], tensor, atol=1e-5, rtol=0)
        moved += int(name in base and not torch.equal(tensor, base[name]))
    assert moved > 0, "the optimizer step changed no weight"


def test_repeated_cross_entropy_steps_halve_the_loss(policy, tiny_tokenizer):
    rewind(policy)
    batch, *_ = sft_batch(tiny_tokenizer, PAIRS)
    losses = []
    for _ in range(30):
        losses.append(policy.forward_backward("policy", batch, loss_fn="cross_entropy").metrics["loss"])
        grad_norm = policy.optim_step("policy")
        assert grad_norm is not None and grad_norm > 0
    assert losses[-1] <= 0.5 * losses[0], losses


def test_a_loss_registered_in_the_driver_reaches_the_workers_through_rays_key_value_store(
    policy, tiny_tokenizer
):
    """SkyRL's registries share their functions through Ray's key-value store, not through named
    actors (none runs); through it a policy loss registered in the driver after start-up is the
    one a worker computes (twice the cross-entropy here)."""
    import ray
    from skyrl.backends.skyrl_train.utils.ppo_utils import (
        AdvantageEstimatorRegistry,
        PolicyLossRegistry,
        cross_entropy_loss,
    )

    for registry in (PolicyLossRegistry, AdvantageEstimatorRegistry):
        with pytest.raises(ValueError):
            ray.get_actor(registry._actor_name)

    def doubled_cross_entropy(*args, **kwargs):
        loss, metrics = cross_entropy_loss(*args, **kwargs)
        return 2 * loss, metrics

    PolicyLossRegistry.register("doubled_cross_entropy", doubled_cross_entropy)
    try:
        rewind(policy)
        batch, *_ = sft_batch(tiny_tokenizer, PAIRS)
        plain = policy.forward_backward("policy", batch, loss_fn="cross_entropy").metrics["loss"]
        rewind(policy)
        doubled = policy.forward_backward("policy", batch, loss_fn="doubled_cross_entropy").metrics
    finally:
        PolicyLossRegistry.unregister("doubled_cross_entropy")
    assert doubled["final_loss" if "final_loss" in doubled else "loss"] == pytest.approx(2 * plain, rel=1e-5)
