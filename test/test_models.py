"""ModelRegistry: model ids -> roles, Tinker-format outputs checked against independent computations."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import hf_logprobs, skyrl_config
from omegaconf import OmegaConf
from safetensors.torch import load_file
from skyrl.backends.skyrl_train.distributed.dispatch import WorkerOutput
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry, ppo_critic_loss

from rllm_skyrl.data.adapter import sft_examples_to_batch
from rllm_skyrl.data.batch_layout import right_aligned
from rllm_skyrl.run_config import losses, make_skyrl_config
from rllm_skyrl.run_config.losses import resolve_loss
from rllm_skyrl.update.models import ModelRegistry
from rllm_skyrl.update.workers import SkyRLWorkers

PAIRS = [("what is 3?", "3"), ("what is 7 plus 2?", "9"), ("what is 12?", "1 2"), ("what is 5?", "5")]


def encoded(tokenizer, pairs=PAIRS) -> list[tuple[list[int], list[int]]]:
    return [
        (tokenizer(p)["input_ids"], tokenizer(r)["input_ids"] + [tokenizer.eos_token_id]) for p, r in pairs
    ]


# --------------------------------------------------------------------------- no Ray


class FakeWorkers:
    """Just enough of SkyRLWorkers to check the registry's rules without starting actors."""

    def __init__(self, roles=("policy", "critic")):
        self.cfg = make_skyrl_config(
            {"trainer.policy.model.path": "/base", "trainer.critic.model.path": "/base"}
        )
        self.roles = roles
        self.calls: list[tuple] = []

    def dp_size(self, role: str) -> int:
        return 1

    def _rows(self, role, batch) -> list[dict]:
        key = "values" if role == "critic" else "logprobs"
        return [{key: [-0.5] * batch["response_mask"].shape[1]} for _ in range(batch.batch_size)]

    def forward(self, role, batch, **kwargs):
        self.calls.append(("forward", role, kwargs))
        return WorkerOutput(loss_fn_outputs=self._rows(role, batch), metrics={"loss": 1.0} if kwargs else {})

    def forward_backward(self, role, batch, **kwargs):
        self.calls.append(("forward_backward", role, kwargs))
        if role == "critic":
            return WorkerOutput(metrics={"critic_loss": 0.25})
        return WorkerOutput(loss_fn_outputs=self._rows(role, batch), metrics={"final_loss": 1.0})

    def set_algorithm_config(self, role, **settings):
        self.calls.append(("set_algorithm_config", role, settings))


def rl_fields(batch: TrainingInputBatch, current_BT: torch.Tensor | None = None, seed: int = 0):
    """Sampler logprobs near ``current_BT`` (the policy's own, so ratios straddle the clip range)
    and one advantage per row, on the response tokens of an SFT-shaped batch."""
    generator = torch.Generator().manual_seed(seed)
    mask_BT = (batch["loss_mask"] > 0).float()
    current_BT = torch.full(mask_BT.shape, -1.0) if current_BT is None else current_BT
    old_BT = (current_BT + 0.15 * torch.randn(mask_BT.shape, generator=generator)) * mask_BT
    batch["action_log_probs"] = old_BT
    batch["rollout_logprobs"] = old_BT.clone()
    batch["advantages"] = torch.randn(mask_BT.shape[0], 1, generator=generator) * mask_BT
    return batch


def critic_fields(batch: TrainingInputBatch, seed: int = 0) -> TrainingInputBatch:
    generator = torch.Generator().manual_seed(seed)
    mask_BT = (batch["loss_mask"] > 0).float()
    batch["values"] = 0.3 * torch.randn(mask_BT.shape, generator=generator) * mask_BT
    batch["returns"] = torch.randn(mask_BT.shape[0], 1, generator=generator) * mask_BT
    return batch


def fake_batch(tiny_tokenizer) -> TrainingInputBatch:
    return sft_examples_to_batch(
        encoded(tiny_tokenizer), pad_token_id=tiny_tokenizer.pad_token_id, loss_reduction="sum"
    )


def test_registry_rules():
    registry = ModelRegistry(FakeWorkers())
    policy = registry.create_model("pol")
    assert (policy.role, policy.base_model) == ("policy", "/base")
    with pytest.raises(ValueError, match="already exists"):
        registry.create_model("pol", model_role="critic")
    with pytest.raises(ValueError, match="policy role already belongs to model 'pol'"):
        registry.create_model("pol2")
    with pytest.raises(ValueError, match="unknown model_role 'ref'"):
        registry.create_model("r", model_role="ref")
    with pytest.raises(ValueError, match="started from '/base', not '/other'"):
        registry.create_model("crit", model_role="critic", base_model="/other")
    critic = registry.create_model("crit", model_role="critic")
    assert critic.base_model == "/base", "a critic shares the policy's base model"
    assert registry.model_ids == ("pol", "crit")
    with pytest.raises(ValueError, match=r"unknown model_id 'nope'; known ids: \['pol', 'crit'\]"):
        registry.optim_step("nope")
    with pytest.raises(ValueError, match="cannot be trained"):
        registry.create_model("")


def test_critic_needs_critic_workers():
    with pytest.raises(ValueError, match=r"no critic workers.*trainer\.critic\.model\.path"):
        ModelRegistry(FakeWorkers(roles=("policy",))).create_model("crit", model_role="critic")


def test_loss_and_role_checks_happen_before_the_workers(tiny_tokenizer):
    workers = FakeWorkers()
    registry = ModelRegistry(workers)
    registry.create_model("pol")
    registry.create_model("crit", model_role="critic")
    batch = fake_batch(tiny_tokenizer)
    with pytest.raises(ValueError, match="'' is the base model.*not a trainable model"):
        registry.forward_backward("", batch, loss_fn="cross_entropy")
    with pytest.raises(ValueError, match="'' is the base model"):
        registry.forward("", batch)
    with pytest.raises(ValueError, match="ppo_critic.*use it on the critic"):
        registry.forward_backward("pol", batch, loss_fn="ppo_critic")
    with pytest.raises(ValueError, match="critic trains with loss_fn='ppo_critic'"):
        registry.forward_backward("crit", batch, loss_fn="cross_entropy")
    with pytest.raises(ValueError, match="needs a loss_fn; policy losses"):
        registry.forward_backward("pol", batch)
    with pytest.raises(ValueError, match=r"missing \['advantages', 'action_log_probs'\]"):
        registry.forward_backward("pol", batch, loss_fn="ppo")
    with pytest.raises(ValueError, match=r"missing \['values', 'returns'\]"):
        registry.forward_backward("crit", batch)
    with pytest.raises(ValueError, match="does not accept config key 'eps_clip_low'"):
        registry.forward("pol", rl_fields(batch), loss_fn="ppo", loss_fn_config={"eps_clip_low": 0.2})
    assert workers.calls == [], "nothing may reach the workers"


def test_critic_value_clip_per_call_and_persistent(tiny_tokenizer):
    workers = FakeWorkers()
    registry = ModelRegistry(workers)
    registry.create_model("crit", model_role="critic")
    batch = critic_fields(fake_batch(tiny_tokenizer))

    def pushed() -> list:
        return [c[2]["value_clip"] for c in workers.calls if c[0] == "set_algorithm_config"]

    out = registry.forward_backward("crit", batch)  # the configured 0.2 is already on the workers
    assert pushed() == [] and out.metrics["loss"] == 0.25
    assert out.loss_fn_outputs == [{} for _ in range(4)], "SkyRL's critic update returns metrics only"
    registry.set_algorithm_config("crit", value_clip=0.5)
    registry.forward_backward("crit", batch, loss_fn="ppo")  # ppo on a critic is ppo_critic
    registry.forward_backward("crit", batch, loss_fn="ppo_critic", loss_fn_config={"value_clip": None})
    registry.forward_backward("crit", batch)
    assert pushed() == [0.5, None, 0.5]
    with pytest.raises(ValueError, match=r"no field\(s\) \['value_clp'\]"):
        registry.set_algorithm_config("crit", value_clip=0.1, value_clp=0.1)


def test_elementwise_loss_is_left_out_under_off_policy_correction(tiny_tokenizer):
    registry = ModelRegistry(FakeWorkers())
    registry.create_model("pol")
    batch = rl_fields(fake_batch(tiny_tokenizer))
    assert "elementwise_loss" in registry.forward("pol", batch, loss_fn="ppo").loss_fn_outputs[0]
    registry.set_algorithm_config("pol", off_policy_correction=_tis_token())
    output = registry.forward("pol", batch, loss_fn="ppo")
    assert set(output.loss_fn_outputs[0]) == {"logprobs"}


def test_elementwise_loss_is_left_out_when_not_asked_for(tiny_tokenizer):
    registry = ModelRegistry(FakeWorkers())
    registry.create_model("pol")
    batch = rl_fields(fake_batch(tiny_tokenizer))
    full = registry.forward_backward("pol", batch, loss_fn="ppo")
    lean = registry.forward_backward("pol", batch, loss_fn="ppo", elementwise_loss=False)
    assert "elementwise_loss" in full.loss_fn_outputs[0]
    assert [set(row) for row in lean.loss_fn_outputs] == [{"logprobs"}] * len(full.loss_fn_outputs)
    assert [row["logprobs"] for row in lean.loss_fn_outputs] == [
        row["logprobs"] for row in full.loss_fn_outputs
    ]
    assert lean.metrics == full.metrics


def test_the_configured_loss_reaches_the_workers_without_a_name_or_overrides(tiny_tokenizer):
    """SkyRL's worker computes its configured loss without a registry lookup or a config merge; any
    other loss, or other values, goes by name with its overrides. (That both give the same loss is
    ``test_forward_backward_matches_forward_and_trains``: ``forward`` always names its loss.)"""
    workers = FakeWorkers()
    registry = ModelRegistry(workers)
    registry.create_model("pol")
    batch = rl_fields(fake_batch(tiny_tokenizer))
    assert workers.cfg.trainer.algorithm.policy_loss_type == "regular"

    def sent(loss_fn, loss_fn_config=None) -> dict:
        registry.forward_backward("pol", batch, loss_fn=loss_fn, loss_fn_config=loss_fn_config)
        return workers.calls[-1][2]

    tighter = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    assert sent("ppo") == {}
    assert sent("ppo", tighter) == {
        "loss_fn": "regular",
        "loss_fn_config": {"policy_loss_type": "regular", "eps_clip_low": 0.1, "eps_clip_high": 0.1},
    }
    assert sent("cispo")["loss_fn"] == "cispo"
    registry.set_algorithm_config("pol", eps_clip_low=0.1, eps_clip_high=0.1)
    # Another loss whose every override the workers already hold: its name alone, no config to merge.
    assert sent(losses.decoupled(resolve_loss("policy", "ppo"))) == {
        "loss_fn": "rllm_skyrl_decoupled:regular"
    }
    assert sent("ppo", tighter) == {}
    registry.set_algorithm_config("pol", policy_loss_type="cispo")  # the workers' loss stays "regular"
    assert sent("cispo")["loss_fn"] == "cispo" and sent("ppo", tighter)["loss_fn"] == "regular"


def _tis_token():
    from skyrl.train.config.config import OffPolicyCorrectionConfig

    return OffPolicyCorrectionConfig(tis_ratio_type="token")


# --------------------------------------------------------------------------- real workers


@pytest.fixture(scope="module")
def registry(ray_cluster, tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    """Policy and critic on one set of workers; ``fresh`` rewinds both to their starting weights."""
    root = tmp_path_factory.mktemp("models")
    cfg = skyrl_config(tiny_model_dir, root, **{"trainer.critic.model.path": tiny_model_dir})
    cfg.trainer.critic.fsdp_config.mixed_precision = cfg.trainer.policy.fsdp_config.mixed_precision
    cfg.trainer.critic.optimizer_config.lr = 1e-3
    cfg.trainer.critic.optimizer_config.weight_decay = 0.0
    workers = SkyRLWorkers(cfg, tiny_tokenizer)
    registry = ModelRegistry(workers)
    registry.create_model("pol")
    registry.create_model("crit", model_role="critic")
    for model_id, role in (("pol", "policy"), ("crit", "critic")):
        workers.save_checkpoint(role, str(root / "start" / role))
        registry.save_hf_model(model_id, str(root / "start_hf" / model_id))
    registry.start_dir = root / "start"
    registry.start_weights = {
        model_id: load_file(str(root / "start_hf" / model_id / "model.safetensors"))
        for model_id in ("pol", "crit")
    }
    yield registry
    workers.shutdown()


def fresh(registry: ModelRegistry) -> None:
    """Drop accumulated gradients (an optimizer step clears them), then reload the starting state."""
    for model_id, role in (("pol", "policy"), ("crit", "critic")):
        registry.optim_step(model_id)
        registry.workers.load_checkpoint(role, str(registry.start_dir / role))


def data(output, key: str) -> list[torch.Tensor]:
    rows = []
    for row in output.loss_fn_outputs:
        entry = row[key]
        assert entry["dtype"] == "float32" and entry["shape"] == [len(entry["data"])]
        rows.append(torch.tensor(entry["data"]))
    return rows


def algorithm_with(registry: ModelRegistry, **overrides):
    """The run's AlgorithmConfig with ``overrides`` merged in, built apart from the registry's copy."""
    algorithm = registry.workers.cfg.trainer.algorithm
    return type(algorithm).from_dict_config(OmegaConf.merge(OmegaConf.structured(algorithm), overrides))


def rl_batch(registry: ModelRegistry, tokenizer, seed: int = 0) -> TrainingInputBatch:
    """An RL batch whose sampler logprobs are the current policy's plus noise."""
    batch = sft_examples_to_batch(
        encoded(tokenizer), pad_token_id=tokenizer.pad_token_id, loss_reduction="sum"
    )
    current = data(registry.forward("pol", batch), "logprobs")
    return rl_fields(batch, right_aligned(current, batch["loss_mask"].shape[1]), seed=seed)


def per_token_loss(loss_name: str, config, logprob: float, old: float, advantage: float) -> float:
    """SkyRL's registered loss on one token: a reference that shares nothing with the registry's path."""
    one = torch.ones(1, 1)
    loss, _ = PolicyLossRegistry.get(loss_name)(
        torch.tensor([[logprob]]),
        torch.tensor([[old]]),
        torch.tensor([[advantage]]),
        config=config,
        loss_mask=one,
        rollout_logprobs=torch.tensor([[old]]),
    )
    return loss.item()


@pytest.mark.slow
def test_cross_entropy_rows_and_loss(registry, tiny_model_dir, tiny_tokenizer, tmp_path):
    pairs = encoded(tiny_tokenizer)[:3]
    batch = sft_examples_to_batch(
        pairs, pad_token_id=tiny_tokenizer.pad_token_id, dp_size=2, loss_reduction="sum"
    )
    assert batch.batch_size == 4 and batch.metadata["pad_size"] == 1
    registry.save_hf_model("pol", str(tmp_path / "now"))
    expected = hf_logprobs(str(tmp_path / "now"), [p for p, _ in pairs], [r for _, r in pairs])
    output = registry.forward("pol", batch, loss_fn="cross_entropy")
    assert len(output.loss_fn_outputs) == 3, "the pad row is dropped"
    for got, ce, want in zip(
        data(output, "logprobs"), data(output, "elementwise_loss"), expected, strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(ce, -want, atol=1e-4, rtol=0)
    assert output.metrics["loss"] == pytest.approx(float(-torch.cat(expected).sum()), rel=1e-4)
    plain = registry.forward("pol", batch)
    assert output.loss_fn_outputs[0].keys() != plain.loss_fn_outputs[0].keys() and plain.metrics == {}
    for got, want in zip(data(plain, "logprobs"), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("loss_fn", "loss_fn_config"),
    [
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("importance_sampling", None),
        ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("dppo", {"delta_low": 0.05, "delta_high": 0.05}),
    ],
)
def test_rl_elementwise_loss_matches_skyrls_loss_per_token(
    registry, tiny_model_dir, tiny_tokenizer, tmp_path, loss_fn, loss_fn_config
):
    """forward with an RL loss: the worker's rows carry CE values; ours are the loss's own terms."""
    pairs = encoded(tiny_tokenizer)
    batch = rl_batch(registry, tiny_tokenizer)
    registry.save_hf_model("pol", str(tmp_path / "now"))
    hf = hf_logprobs(str(tmp_path / "now"), [p for p, _ in pairs], [r for _, r in pairs])
    output = registry.forward("pol", batch, loss_fn=loss_fn, loss_fn_config=loss_fn_config)

    resolved = resolve_loss("policy", loss_fn, loss_fn_config)
    reference_config = algorithm_with(registry, **resolved.skyrl_config)
    total, clipped = 0.0, 0
    logprobs, elementwise = data(output, "logprobs"), data(output, "elementwise_loss")
    for i, (lp_T, loss_T, want_T) in enumerate(zip(logprobs, elementwise, hf, strict=True)):
        torch.testing.assert_close(lp_T, want_T, atol=1e-4, rtol=0)
        n = len(lp_T)
        old_T = batch["action_log_probs"][i, -n:]
        adv_T = batch["advantages"][i, -n:]
        for t in range(n):
            expected = per_token_loss(
                resolved.skyrl_loss_name, reference_config, lp_T[t].item(), old_T[t].item(), adv_T[t].item()
            )
            assert loss_T[t].item() == pytest.approx(expected, abs=1e-6)
            ratio = torch.exp(lp_T[t] - old_T[t]).item()
            clipped += int(not 0.9 <= ratio <= 1.1)
        total += float(loss_T.sum())
    assert clipped > 0, "some ratios must leave the clip range, or the test checks nothing"
    assert output.metrics["loss"] == pytest.approx(total, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_forward_backward_matches_forward_and_trains(registry, tiny_tokenizer):
    fresh(registry)
    batch = rl_batch(registry, tiny_tokenizer, seed=1)
    before = registry.forward("pol", batch, loss_fn="ppo")
    update = registry.forward_backward("pol", batch, loss_fn="ppo")
    for a, b in zip(data(before, "elementwise_loss"), data(update, "elementwise_loss"), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert update.metrics["loss"] == pytest.approx(update.metrics["final_loss"])
    assert update.metrics["loss"] == pytest.approx(before.metrics["loss"], rel=1e-5)
    assert registry.optim_step("pol") > 0
    after = registry.forward("pol", batch, loss_fn="ppo")
    assert after.metrics["loss"] < before.metrics["loss"], "one step on the same rows lowers their loss"


@pytest.mark.slow
def test_critic_values_match_a_direct_forward(registry, tiny_tokenizer, tmp_path):
    """The critic's values against Qwen3 + the exported value head, run outside SkyRL."""
    from transformers import AutoModel

    pairs = encoded(tiny_tokenizer)
    batch = sft_examples_to_batch(pairs, pad_token_id=tiny_tokenizer.pad_token_id, loss_reduction="sum")
    output = registry.forward("crit", batch)
    assert set(output.loss_fn_outputs[0]) == {"values"} and output.metrics == {}
    export = tmp_path / "critic"
    registry.save_hf_model("crit", str(export))
    value_head = load_file(str(export / "model.safetensors"))["value_head.weight"]
    base = AutoModel.from_pretrained(str(export), dtype=torch.float32).eval()
    with torch.no_grad():
        for (prompt, response), got in zip(pairs, data(output, "values"), strict=True):
            hidden = base(torch.tensor([prompt + response])).last_hidden_state[0]
            # SkyRL's critic predicts a response token's value at the position before it.
            want = (hidden @ value_head.T).squeeze(-1)[len(prompt) - 1 : -1]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_critic_value_clip_reaches_the_loss(registry, tiny_tokenizer):
    """set_algorithm_config then a critic update with no loss name: SkyRL's critic loss with that clip."""
    fresh(registry)
    batch = critic_fields(
        sft_examples_to_batch(
            encoded(tiny_tokenizer), pad_token_id=tiny_tokenizer.pad_token_id, loss_reduction="sum"
        )
    )
    values_BT = right_aligned(data(registry.forward("crit", batch), "values"), batch["loss_mask"].shape[1])
    losses = []
    for value_clip in (0.05, None):
        reference = dataclasses.replace(registry.workers.cfg.trainer.algorithm, value_clip=value_clip)
        expected, _ = ppo_critic_loss(
            values_BT, batch["values"], batch["returns"], reference, loss_mask=batch["loss_mask"]
        )
        registry.set_algorithm_config("crit", value_clip=value_clip)
        output = registry.forward_backward("crit", batch)
        assert output.metrics["loss"] == pytest.approx(expected.item(), rel=1e-5)
        losses.append(output.metrics["loss"])
    assert losses[0] != pytest.approx(losses[1], rel=1e-3), "the clip must change the loss here"
    registry.set_algorithm_config("crit", value_clip=registry.workers.cfg.trainer.algorithm.value_clip)


def _train_once(registry: ModelRegistry, parts: list[TrainingInputBatch], export_root) -> dict:
    """forward_backward on each part, one optimizer step per model; weights exported after it."""
    fresh(registry)
    for part in parts:
        registry.forward_backward("pol", part, loss_fn="ppo")
        registry.forward_backward("crit", part)
    result = {"pol": registry.optim_step("pol"), "crit": registry.optim_step("crit")}
    for model_id in ("pol", "crit"):
        registry.save_hf_model(model_id, str(export_root / model_id))
        result[f"{model_id}_weights"] = load_file(str(export_root / model_id / "model.safetensors"))
    return result


@pytest.mark.slow
def test_gradient_accumulation_equals_one_call(registry, tiny_tokenizer, tmp_path):
    """Two forward_backward calls then one optim_step == one call on both halves, for policy and critic.

    Policy losses are sums, so advantages are scaled for all four rows before splitting. The critic
    averages each micro-batch and divides by the micro-batches accumulated at optim_step, so the
    halves have equal row counts (each is one micro-batch of 2; the whole is one micro-batch of 4).
    """
    fresh(registry)
    batch = critic_fields(rl_batch(registry, tiny_tokenizer, seed=2), seed=3)
    batch["advantages"] = batch["advantages"] / batch["loss_mask"].sum()
    halves = [batch.slice(0, 2), batch.slice(2, 4)]
    for half in halves:
        half.metadata = {"response_length": batch.metadata["response_length"]}
    accumulated = _train_once(registry, halves, tmp_path / "accumulated")
    single = _train_once(registry, [batch], tmp_path / "single")
    for model_id in ("pol", "crit"):
        assert accumulated[model_id] == pytest.approx(single[model_id], rel=1e-4)
        start = registry.start_weights[model_id]
        moved = 0
        for name, tensor in single[f"{model_id}_weights"].items():
            torch.testing.assert_close(accumulated[f"{model_id}_weights"][name], tensor, atol=1e-6, rtol=1e-5)
            moved += int(not torch.equal(tensor, start[name]))
        assert moved > 0, f"the {model_id} step changed no weight"
