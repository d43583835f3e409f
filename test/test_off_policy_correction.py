"""Off-policy correction (rLLM's ``rollout_correction``) through SkyRL's own.

- The config layer: ``tis_mode``/``tis_cap`` are SkyRL's ``off_policy_correction``; losses that
  cannot apply it, and bypass mode with several optimizer steps per batch, are refused in one line.
- The decoupled loss of bypass mode, on tensors: SkyRL's loss with the trainer's own log-probs as
  the old ones, so the weight compares the trainer with the sampler (never exactly 1).
- Through SkyRL's workers on CPU: a workflow reports its sampled log-probs shifted by ``SHIFT``, so
  every token's true weight is ``exp(-SHIFT)``; the metrics must say so in both bypass modes.
- (slow) A fully-async run with stale rollouts and TIS learns the digit task, syncing once per update
  while rollouts go on (rLLM's fully-async learning run).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import compose_run, compose_unified, run_dirs
from rllm_harness import (
    digit_reward,
    digit_rows,
    last_mean,
    learning_digits,
    requests_during,
    requires_rllm,
    rllm_config,
    run_rllm,
    syncs_by_hook,
)
from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
from skyrl.train.config import AlgorithmConfig

from rllm_skyrl.cli import main as rllm_skyrl_cli
from rllm_skyrl.rllm_names import Episode, Step, Trajectory, Workflow
from rllm_skyrl.run.metrics_file import read_metrics
from rllm_skyrl.run_config import ConfigError, losses, resolve_run_config
from rllm_skyrl.run_config.losses import resolve_loss
from rllm_skyrl.training_run import train
from rllm_skyrl.update import off_policy
from rllm_skyrl.update.workers import SkyRLWorkers

TIS = "rllm.algorithm.rollout_correction.tis_mode"
BYPASS = "rllm.algorithm.rollout_correction.bypass_mode"
CAP = "rllm.algorithm.rollout_correction.tis_cap"
SHIFT = -0.25  # added to every sampled logprob the workflow reports: true weight exp(0.25) = 1.284


def resolve(*overrides: str):
    return resolve_run_config(compose_unified(*overrides))


# --------------------------------------------------------------------------- the config layer


@pytest.mark.parametrize(("mode", "cap"), [("token", 1.5), ("sequence", 4.0)])
def test_tis_mode_and_cap_are_skyrls_off_policy_correction(mode, cap):
    run = resolve(f"{TIS}={mode}", f"{CAP}={cap}")
    correction = run.skyrl.trainer.algorithm.off_policy_correction
    assert correction.tis_ratio_type == mode
    assert correction.token_tis_ratio_clip_high == correction.sequence_tis_ratio_clip_high == cap
    assert run.off_policy.setting == f"{TIS}={mode!r}"


def test_without_tis_the_losses_are_skyrls_own():
    """The quickstart's run: no correction, SkyRL's ``regular`` loss by name, nothing decoupled."""
    run = resolve()
    assert run.skyrl.trainer.algorithm.off_policy_correction.tis_ratio_type is None
    assert run.off_policy.setting is None and not run.off_policy.decoupled
    assert run.policy_loss == resolve_loss("policy", "ppo") and run.bypass_mode


@pytest.mark.parametrize("loss_fn", ["ppo", "gspo", "cispo"])
def test_bypass_mode_trains_the_decoupled_loss_and_recomputation_skyrls(loss_fn):
    bypass = resolve(f"{TIS}=token", f"rllm.algorithm.loss_fn={loss_fn}")
    base = resolve_loss("policy", loss_fn)
    assert bypass.off_policy.decoupled and losses.is_decoupled(bypass.policy_loss.skyrl_loss_name)
    assert bypass.policy_loss.skyrl_loss_name.endswith(f":{base.skyrl_loss_name}")
    assert bypass.policy_loss.skyrl_config == base.skyrl_config  # SkyRL's ppo asserts policy_loss_type
    recomputed = resolve(f"{TIS}=token", f"rllm.algorithm.loss_fn={loss_fn}", f"{BYPASS}=false")
    assert not recomputed.off_policy.decoupled and recomputed.policy_loss == base


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["rllm.algorithm.loss_fn=importance_sampling"], ["loss_fn='importance_sampling'", "no off-policy"]),
        (["rllm.algorithm.loss_fn=cross_entropy"], ["loss_fn='cross_entropy'", "supervised"]),
        (["rllm.algorithm.loss_fn=dppo"], ["loss_fn='dppo'", "twice"]),
        (
            ["rllm.algorithm.loss_fn=cispo", "training.loss_fn_config={cispo_anchor: rollout}"],
            ["loss_fn='cispo'", "cispo_anchor='rollout'", "twice"],
        ),
        (["rllm.algorithm.adv_estimator=rloo"], ["loss_fn=null (adv_estimator=rloo: 'importance_sampling')"]),
        (
            ["+rllm.algorithm.estimator_map={judge:[grpo,dppo]}"],
            ["the loss of trajectory role 'judge' ('dppo')", "twice"],
        ),
    ],
)
def test_losses_that_cannot_apply_it_are_refused_naming_setting_and_loss(overrides, fragments):
    with pytest.raises(ConfigError) as refused:
        resolve(f"{TIS}=token", *overrides)
    message = str(refused.value)
    assert message.startswith(f"{TIS}='token' cannot apply to") and "use ppo, gspo or cispo" in message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("steps", ["training.num_minibatches=2", "training.update_epochs=2"])
def test_bypass_mode_with_several_optimizer_steps_per_batch_is_refused(steps):
    with pytest.raises(ConfigError) as refused:
        resolve(f"{TIS}=sequence", steps)
    message = str(refused.value)
    assert f"{TIS}='sequence' with {BYPASS}=true and 2 optimizer steps per batch" in message
    assert f"{steps}," in message or f"{steps})" in message
    assert message.endswith(
        f"set {BYPASS}=false (the old log-probs are then recomputed once before the update)"
    )
    assert not resolve(f"{TIS}=sequence", steps, f"{BYPASS}=false").off_policy.decoupled


def test_skyrls_own_keys_turn_it_on_as_well():
    key = "skyrl.trainer.algorithm.off_policy_correction.sequence_mask_metric"
    run = resolve(f"+{key}=geometric")
    assert run.off_policy.setting == f"{key}='geometric'" and run.off_policy.decoupled
    with pytest.raises(ConfigError, match=f"{key}='geometric' cannot apply to .*importance_sampling"):
        resolve(f"+{key}=geometric", "rllm.algorithm.loss_fn=importance_sampling")


def test_per_role_losses_set_in_code_are_checked_and_decoupled_too():
    """As rLLM's ``AlgorithmConfig`` carries them: ``estimator_map`` and ``loss_fn_map``."""
    run = resolve(f"{TIS}=token")
    config = SimpleNamespace(estimator_map={"judge": "grpo"}, loss_fn_map={"judge": "cispo"})
    assert losses.is_decoupled(run.with_algorithm_config(config).loss_for("judge").skyrl_loss_name)
    refused = SimpleNamespace(estimator_map={"judge": "reinforce"}, loss_fn_map={})
    with pytest.raises(ConfigError, match=r"the loss of trajectory role 'judge' \('importance_sampling'\)"):
        run.with_algorithm_config(refused)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{TIS}=token", "rllm.algorithm.loss_fn=importance_sampling"], f"{TIS}='token' cannot apply to"),
        ([f"{TIS}=token", "training.update_epochs=3"], "3 optimizer steps per batch"),
        ([f"{TIS}=tokens"], f"{TIS}='tokens': expected null (off), token or sequence"),
    ],
)
def test_plan_refuses_in_one_line(overrides, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        rllm_skyrl_cli(["plan", "model.path=tiny", *overrides])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert stop.value.code == 2 and len(errors) == 1 and expected in errors[0], err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- the decoupled loss


def correction_config(mode: str, cap: float, policy_loss_type: str) -> AlgorithmConfig:
    config = AlgorithmConfig(policy_loss_type=policy_loss_type)
    config.off_policy_correction.tis_ratio_type = mode
    config.off_policy_correction.token_tis_ratio_clip_high = cap
    config.off_policy_correction.sequence_tis_ratio_clip_high = cap
    return config


# Two rows, three tokens (the last of row 2 is padding); trainer-vs-sampler log-ratios per token.
LOG_RATIO_BT = torch.tensor([[0.25, -0.5, 1.0], [0.1, 0.3, 0.0]])
MASK_BT = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADVANTAGE_BT = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])


@pytest.mark.parametrize("skyrl_loss", ["regular", "gspo", "cispo"])
@pytest.mark.parametrize(("mode", "cap"), [("token", 1.5), ("sequence", 1.5)])
def test_the_decoupled_loss_weighs_the_trainer_against_the_sampler(skyrl_loss, mode, cap):
    """Its gradient is SkyRL's policy gradient at the current policy, times SkyRL's TIS weight
    ``min(exp(trainer - sampler), cap)``; the batch's old log-probs (the sampler's) play no part."""
    trainer_BT = torch.full((2, 3), -1.0, requires_grad=True)
    sampler_BT = trainer_BT.detach() - LOG_RATIO_BT
    config = correction_config(mode, cap, skyrl_loss)
    loss, metrics = off_policy.DecoupledLoss(skyrl_loss)(
        trainer_BT, sampler_BT, ADVANTAGE_BT, config=config, loss_mask=MASK_BT, rollout_logprobs=sampler_BT
    )
    (gradient_BT,) = torch.autograd.grad(loss, trainer_BT)
    if mode == "token":
        weight_BT = LOG_RATIO_BT.exp().clamp(max=cap)
    else:
        weight_BT = (LOG_RATIO_BT * MASK_BT).sum(-1, keepdim=True).exp().clamp(max=cap).expand(2, 3)
    # ratio exp(logp - sg(logp)) == 1: ppo and gspo give -A d(ratio), cispo -A d(logp) (its ratio is 1)
    torch.testing.assert_close(gradient_BT, -ADVANTAGE_BT * weight_BT * MASK_BT)
    assert metrics["is_ratio_mean"] == pytest.approx(
        (LOG_RATIO_BT.exp() * MASK_BT).sum().item() / 5, rel=1e-5
    )
    assert metrics["is_ratio_max"] == pytest.approx(math.exp(1.0), rel=1e-5)
    # The same numbers as SkyRL's registered loss with the detached trainer log-probs as the old ones.
    expected, _ = PolicyLossRegistry.get(skyrl_loss)(
        trainer_BT,
        trainer_BT.detach(),
        ADVANTAGE_BT,
        config=config,
        loss_mask=MASK_BT,
        rollout_logprobs=sampler_BT,
    )
    torch.testing.assert_close(loss, expected)


# --------------------------------------------------------------------------- through SkyRL's workers


class ShiftedLogprobsWorkflow(Workflow):
    """Reports its sampled log-probs shifted by ``SHIFT``; rewards each task's first rollout."""

    async def run(self, task, uid, **kwargs):
        messages = [{"role": "user", "content": task["question"]}]
        output = await self.rollout_engine.get_model_response(messages, application_id=uid, **kwargs)
        output.logprobs = [lp + SHIFT for lp in output.logprobs]
        reward = float(uid.endswith(":0"))
        step = Step(chat_completions=messages, model_output=output, reward=reward, done=True)
        return Episode(
            id=uid, task=task, trajectories=[Trajectory(name="agent", steps=[step], reward=reward)]
        )


def shifted_run(root: Path, monkeypatch, *overrides: str) -> tuple[dict, list[tuple[str, str, dict]]]:
    """One step of ``ShiftedLogprobsWorkflow``: its metrics, and every call on the workers as
    ``(method, role, loss keyword arguments)`` (none: the loss the workers were built with)."""
    calls: list[tuple[str, str, dict]] = []
    for method in ("forward", "forward_backward"):
        original = getattr(SkyRLWorkers, method)

        def recording(self, role, *args, _method=method, _original=original, **kwargs):
            calls.append((_method, role, dict(kwargs)))
            return _original(self, role, *args, **kwargs)

        monkeypatch.setattr(SkyRLWorkers, method, recording)
    cfg = compose_run(
        *run_dirs(root),
        "rllm.data.train_batch_size=4",
        "training.group_size=2",
        "training.learning_rate=1e-2",
        "rllm.data.max_prompt_length=64",
        "rllm.data.max_response_length=3",
        "rllm.trainer.total_batches=1",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.save_freq=0",
        *overrides,
    )
    rows = [{"id": f"t{i}", "question": f"what is {i}?"} for i in range(4)]
    run_dir = train(cfg, workflow_class=ShiftedLogprobsWorkflow, train_dataset=rows)
    (record,) = [r for r in read_metrics(run_dir) if "progress/batch" in r]
    return record, calls


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("bypass", [True, False], ids=["bypass", "recomputed"])
def test_the_weights_compare_the_trainer_with_the_sampler_in_both_modes(tmp_path, monkeypatch, bypass):
    """Step 1 trains the initial weights, which the server sampled with: the trainer's log-probs are
    the server's to float rounding, so every weight is exp(-SHIFT) = 1.284 and the cap 1.2 cuts all.

    Bypass mode gets there with no forward pass before the update (its decoupled loss goes to the
    workers by name alone: no config to merge); recomputation with one, and the workers' own loss."""
    record, calls = shifted_run(tmp_path, monkeypatch, f"{TIS}=token", f"{CAP}=1.2", f"{BYPASS}={bypass}")
    if bypass:
        assert calls == [("forward_backward", "policy", {"loss_fn": "rllm_skyrl_decoupled:regular"})]
    else:
        assert calls == [("forward", "policy", {}), ("forward_backward", "policy", {})]
    assert record["rollout_correction/rollout_is_mean"] == pytest.approx(math.exp(-SHIFT), rel=1e-4)
    assert record["rollout_correction/rollout_is_max"] == pytest.approx(math.exp(-SHIFT), rel=1e-4)
    assert record["rollout_correction/rollout_is_ratio_fraction_high"] == 1.0
    assert record["train/grad_norm"] > 0


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_without_tis_a_step_calls_the_workers_as_the_quickstart_always_did(tmp_path, monkeypatch):
    """No forward pass, one forward-backward with the loss the workers were built with (no lookup,
    no config merge), and no correction metrics."""
    record, calls = shifted_run(tmp_path, monkeypatch)
    assert calls == [("forward_backward", "policy", {})]
    assert not [key for key in record if key.startswith("rollout_correction/")]


@requires_rllm
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.usefixtures("ray_cluster")
def test_fully_async_with_stale_rollouts_and_tis_learns_the_digit_task(tmp_path, partly_taught_model):
    """rLLM's fully-async mode lets rollouts run up to half a step ahead of the weights
    (``staleness_threshold=0.5``); TIS in bypass mode (the default) weighs each token by
    ``min(pi_trainer / pi_sampler, 2)``. The run learns, and its weights are not all 1: the
    rollouts really were off-policy and the correction really weighed them. It is also the
    fully-async learning run of rLLM's contract: one weight sync per update (in
    ``on_policy_updated``), with rollouts going on while the workers train."""
    from rllm.workflows.simple_workflow import SimpleWorkflow

    cfg = rllm_config(
        tmp_path,
        *learning_digits(partly_taught_model),
        "rllm.trainer.test_freq=0",
        "training.group_size=32",
        "validation.group_size=4",
        "data.train_batch_size=16",
        "rllm.trainer.val_before_train=false",
        "rllm.trainer.total_batches=51",
        "rllm.async_training.enable=true",
        "rllm.async_training.mini_batch_size=16",
        "rllm.async_training.fwd_bwd_group_size=4",
        "rllm.async_training.staleness_threshold=0.5",
        "rllm.workflow.raise_on_error=false",
        f"{TIS}=token",
    )
    backend = run_rllm(cfg, SimpleWorkflow, {"reward_function": digit_reward}, digit_rows(4096))
    records = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    print("\nreward per step:", " ".join(f"{r['reward/mean']:.2f}" for r in records))
    assert last_mean(records[:10], "reward/mean") <= 0.3
    assert last_mean(records, "reward/mean") >= 0.8
    updates = [shape["weight_version"] for name, shape in backend.calls if name == "on_policy_updated"]
    assert syncs_by_hook(backend) == {"on_policy_updated": updates}
    assert requests_during(backend) > 0
    stale = [r for r in records if r["async/staleness_max"] > 0]
    assert len(stale) >= len(records) // 2, "the rollouts ran ahead of the weights"
    # Under the sampler a weight's expectation is 1, so its mean stays near 1; the spread shows
    # the staleness (trainer and server agree to ~1e-6 on the same weights).
    assert statistics.median(r["rollout_correction/rollout_is_max"] for r in stale) > 1.05
    assert max(abs(r["rollout_correction/rollout_is_mean"] - 1.0) for r in stale) > 1e-3
