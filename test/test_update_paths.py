"""SkyRLBackend's update paths through SkyRL's real workers on CPU, and what a failed start leaves.

One short run (``update_run``) exercises, on purpose together, the options that shape an update:
``training.num_minibatches=2`` and ``training.update_epochs=2`` (4 optimizer steps per batch), the
KL term (``rllm.algorithm.kl_beta > 0``: a reference worker), old logprobs recomputed by the
trainer (``rollout_correction.bypass_mode=false``), and ``training.filter_zero_variance_groups``.
Its workflow makes the rewards deterministic: in step 1 even-numbered tasks get rewards [1, 0]
and odd ones [0, 0] (filtered out); in step 2 every group is flat, so every row is dropped and the
update is skipped. It also shifts the logprobs it reports by ``SHIFT``, so the sampler's numbers
can be told from the trainer's. Every call the backend makes on the workers is recorded.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import ray
import torch
from helpers import compose_run, compose_unified, hf_logprobs, hf_model, run_dirs, wait_until
from skyrl.backends.skyrl_train.utils.ppo_utils import compute_approx_kl

from rllm_skyrl import ray_cluster, runtime
from rllm_skyrl.backend import SkyRLBackend
from rllm_skyrl.rllm_names import Episode, Step, Trajectory, Workflow
from rllm_skyrl.run.metrics_file import read_metrics
from rllm_skyrl.training_run import train
from rllm_skyrl.update.workers import SkyRLWorkers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

SHIFT = -0.25  # added to every sampled logprob the workflow reports
KL_BETA = 0.01
KL_ESTIMATOR = "k3"  # SkyRL's default (trainer.algorithm.kl_estimator_type)
TASKS_PER_STEP = 4
SAME_MATH = 1e-4  # fp32 on both sides of a comparison: only float rounding may differ


class ScriptedRewardWorkflow(Workflow):
    """Rewards from the task number, rollout index and weight version (see the module docstring)."""

    async def run(self, task, uid, **kwargs):
        messages = [{"role": "user", "content": task["question"]}]
        output = await self.rollout_engine.get_model_response(messages, **kwargs)
        output.logprobs = [lp + SHIFT for lp in output.logprobs]
        first_batch = output.weight_version == 0
        reward = float(first_batch and int(task["id"][1:]) % 2 == 0 and uid.endswith(":0"))
        step = Step(chat_completions=messages, model_output=output, reward=reward, done=True)
        return Episode(
            id=uid, task=task, trajectories=[Trajectory(name="agent", steps=[step], reward=reward)]
        )


@dataclass
class Call:
    name: str  # forward | forward_backward | optim_step
    role: str
    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    uids: list[str] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)  # the worker's, per row
    metrics: dict = field(default_factory=dict)


@dataclass
class UpdateRun:
    run_dir: Path
    ckpt_dir: Path
    calls_by_step: dict[int, list[Call]]
    metrics: dict[int, dict]


def _record_worker_calls(monkeypatch) -> tuple[list[Call], list[int]]:
    """Every forward / forward_backward / optim_step the backend sends to SkyRL's workers, in order,
    and the position in that list where each training step ended."""
    calls: list[Call] = []
    step_ends: list[int] = []

    def spy(name: str):
        original = getattr(SkyRLWorkers, name)

        def recording(self, role, *args, **kwargs):
            out = original(self, role, *args, **kwargs)
            call = Call(name, role)
            if args:
                batch = args[0]
                call.batch = {key: batch[key].clone() for key in batch.keys()}
                call.uids = list(batch.metadata.get("uids", []))
                call.logprobs = [row["logprobs"] for row in out.loss_fn_outputs if "logprobs" in row]
                call.metrics = dict(out.metrics)
            calls.append(call)
            return out

        monkeypatch.setattr(SkyRLWorkers, name, recording)

    for name in ("forward", "forward_backward", "optim_step"):
        spy(name)
    on_batch_end = SkyRLBackend.on_batch_end

    async def marking(self, trainer_state):
        step_ends.append(len(calls))
        await on_batch_end(self, trainer_state)

    monkeypatch.setattr(SkyRLBackend, "on_batch_end", marking)
    return calls, step_ends


@pytest.fixture(scope="module")
def update_run(tmp_path_factory) -> UpdateRun:
    root = tmp_path_factory.mktemp("update_run")
    cfg = compose_run(
        *run_dirs(root),
        f"rllm.data.train_batch_size={TASKS_PER_STEP}",
        "training.group_size=2",
        "training.num_minibatches=2",
        "training.update_epochs=2",
        "training.filter_zero_variance_groups=true",
        f"rllm.algorithm.kl_beta={KL_BETA}",
        "rllm.algorithm.rollout_correction.bypass_mode=false",
        "training.learning_rate=1e-2",
        "rllm.data.max_prompt_length=64",
        "rllm.data.max_response_length=3",
        "rllm.trainer.total_batches=2",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.save_freq=2",
    )
    rows = [{"id": f"t{i}", "question": f"what is {i}?"} for i in range(2 * TASKS_PER_STEP)]
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls, step_ends = _record_worker_calls(monkeypatch)
        run_dir = train(cfg, workflow_class=ScriptedRewardWorkflow, train_dataset=rows)
    assert len(step_ends) == 2, step_ends
    calls_by_step = {1: calls[: step_ends[0]], 2: calls[step_ends[0] : step_ends[1]]}
    metrics = {r["step"]: r for r in read_metrics(run_dir) if "progress/batch" in r}
    return UpdateRun(run_dir, root / "ckpt", calls_by_step, metrics)


def _rows(call: Call, key: str) -> list[torch.Tensor]:
    """``key`` on each row's loss tokens (responses are right-aligned: the mask says where)."""
    mask = call.batch["loss_mask"] > 0
    return [call.batch[key][row][mask[row]] for row in range(mask.shape[0])]


def _sequences(call: Call) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) of each single-turn row: ``[PAD | prompt | response]``."""
    pairs = []
    for row in range(call.batch["sequences"].shape[0]):
        real = call.batch["sequences"][row][call.batch["attention_mask"][row].bool()].tolist()
        n_response = int((call.batch["loss_mask"][row] > 0).sum())
        pairs.append((real[:-n_response], real[-n_response:]))
    return pairs


def test_minibatches_and_epochs_step_the_optimizer_once_per_minibatch_and_epoch(update_run):
    """Step 1 keeps 2 groups (4 rows): mini-batches [group a], [group b], each trained twice."""
    sequence = [(c.name, c.role) for c in update_run.calls_by_step[1] if c.name != "forward"]
    fb, opt = ("forward_backward", "policy"), ("optim_step", "policy")
    assert sequence == [fb, opt, fb, opt, fb, opt, fb, opt]
    updates = [c for c in update_run.calls_by_step[1] if c.name == "forward_backward"]
    first, second = updates[0].uids, updates[1].uids
    assert len(first) == len(second) == 2 and len(set(first)) == len(set(second)) == 1 and first != second
    assert [c.uids for c in updates] == [first, second, first, second], "epoch 2 repeats epoch 1's rows"
    for a, b in zip(updates[:2], updates[2:], strict=True):
        torch.testing.assert_close(a.batch["advantages"], b.batch["advantages"], rtol=0, atol=0)
    # SkyRL's own count: AdamW stepped 4 times in all (step 2 was skipped, see below).
    optim = torch.load(
        update_run.ckpt_dir / "global_step_2" / "policy" / "optim_world_size_1_rank_0.pt", weights_only=False
    )
    assert {int(state["step"]) for state in optim["state"].values()} == {4}


def test_each_minibatch_carries_its_own_token_mean(update_run):
    """token_mean per mini-batch: a row's advantage is its GRPO advantage over the mini-batch's
    loss tokens (SkyRL's policy loss sums), computed here from the rewards in the batch."""
    updates = [c for c in update_run.calls_by_step[1] if c.name == "forward_backward"][:2]
    for call in updates:
        rewards = call.batch["rewards"].sum(dim=1)
        assert sorted(rewards.tolist()) == [0.0, 1.0]  # one group: rewards [1, 0]
        grpo = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        tokens = int((call.batch["loss_mask"] > 0).sum())
        for advantage_T, expected in zip(_rows(call, "advantages"), grpo / tokens, strict=True):
            torch.testing.assert_close(advantage_T, torch.full_like(advantage_T, expected.item()))


def test_old_logprobs_are_the_trainers_and_the_reference_feeds_the_kl_loss(update_run, tiny_model_dir):
    calls = update_run.calls_by_step[1]
    assert sorted({(c.name, c.role) for c in calls if c.name == "forward"}) == [
        ("forward", "policy"),  # old logprobs, recomputed (bypass_mode=false)
        ("forward", "ref"),  # a reference worker exists because kl_beta > 0
    ]
    model = hf_model(tiny_model_dir)
    updates = [c for c in calls if c.name == "forward_backward"]
    for index, call in enumerate(updates):
        pairs = _sequences(call)
        initial = hf_logprobs(model, [p for p, _ in pairs], [r for _, r in pairs])
        old, base = _rows(call, "action_log_probs"), _rows(call, "base_action_log_probs")
        sampled = _rows(call, "rollout_logprobs")
        for old_T, base_T, sampled_T, initial_T in zip(old, base, sampled, initial, strict=True):
            # Step 1 starts from the initial weights: the trainer's old logprobs are the model's
            # own, not what the sampler reported (shifted by SHIFT).
            assert (old_T - initial_T).abs().max() <= SAME_MATH
            assert (sampled_T - (initial_T + SHIFT)).abs().max() <= SAME_MATH
            assert (base_T - initial_T).abs().max() <= SAME_MATH  # the frozen reference
        # The worker's KL term is SkyRL's estimator between its current logprobs and the reference's.
        current = [torch.tensor(row) for row in call.logprobs]
        kl_per_row = [
            compute_approx_kl(c[None], b[None], kl_estimator_type=KL_ESTIMATOR).mean()
            for c, b in zip(current, base, strict=True)
        ]
        expected_kl = torch.stack(kl_per_row).mean().item()
        assert call.metrics["policy_kl"] == pytest.approx(expected_kl, rel=1e-3, abs=1e-7)
        if index == 0:
            assert expected_kl < 1e-8  # the policy is still the reference
    assert updates[-1].metrics["policy_kl"] > 1e-6, "after three optimizer steps the policy moved"
    assert update_run.metrics[1]["train/kl"] == pytest.approx(
        sum(c.metrics["policy_kl"] for c in updates) / len(updates), rel=1e-3
    )


def test_zero_variance_groups_are_filtered_and_an_empty_batch_skips_the_update(update_run):
    first, second = update_run.metrics[1], update_run.metrics[2]
    assert first["batch/filtered_zero_variance_groups"] == TASKS_PER_STEP // 2
    assert second["batch/filtered_zero_variance_groups"] == TASKS_PER_STEP
    assert second["batch/skipped_update"] == 1.0 and "batch/skipped_update" not in first
    assert update_run.calls_by_step[2] == [], "a skipped update calls no worker"
    assert "time/weight_sync" in first and "time/weight_sync" not in second  # nothing new to publish


# --------------------------------------------------------------------------- failed starts


def _run_processes() -> dict[int, str]:
    """This test process's descendants (Ray's raylet and its workers, our servers): pid -> command."""
    found = {}
    for process in psutil.Process().children(recursive=True):
        try:
            found[process.pid] = " ".join(process.cmdline())
        except psutil.Error:
            pass
    return found


def _started_parts(before: dict[int, str]) -> list[str]:
    """Workers (Ray actors) and inference servers started since ``before`` that are still alive."""
    now = _run_processes()
    return [
        f"{pid}: {command[:80]}"
        for pid, command in now.items()
        if pid not in before and ("Worker" in command or "rllm_skyrl.inference" in command)
    ]


@pytest.fixture
def ray_ownership(monkeypatch):
    """The backend believes it started Ray (so it must stop it); ``ray.shutdown`` is recorded instead
    of stopping the shared cluster, and so is the stop of the suite's launched Ray."""
    shutdowns = []
    real_start = runtime.start_ray
    monkeypatch.setattr(runtime, "start_ray", lambda *a, **k: real_start(*a, **k) or True)
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: shutdowns.append("ray.shutdown"))
    monkeypatch.setattr(ray_cluster.local_ray, "stop", lambda *a: None)
    return shutdowns


def _start_backend(tmp_path, *overrides: str) -> SkyRLBackend:
    backend = SkyRLBackend(compose_unified(*run_dirs(tmp_path), *overrides))
    backend.validate_config()
    return backend


def test_an_unreachable_server_url_is_a_clear_error_and_nothing_is_left(tmp_path, ray_ownership):
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        backend = _start_backend(tmp_path, f"inference.urls=[{url}]")
        before = _run_processes()
        with pytest.raises(
            RuntimeError, match=f"inference server {url} is not reachable.*check inference.urls"
        ):
            backend.init_rollout_engine(total_training_steps=1)
    assert backend.runtime is None and backend not in SkyRLBackend._running
    wait_until(lambda: not _started_parts(before), 60, "the workers to exit")
    assert len(ray_ownership) == 1, "the Ray the backend started must be stopped"


def test_a_failure_after_the_servers_started_stops_servers_workers_and_ray(
    tmp_path, ray_ownership, monkeypatch
):
    import rllm_skyrl.backend as backend_module

    started: list[list[str]] = []

    def failing_update(*args, **kwargs):
        started.append(_started_parts(before))
        raise RuntimeError("injected failure after everything started")

    monkeypatch.setattr(backend_module, "PolicyUpdate", failing_update)
    backend = _start_backend(tmp_path)
    before = _run_processes()
    with pytest.raises(RuntimeError, match="injected failure"):
        backend.init_rollout_engine(total_training_steps=1)
    (running,) = started
    assert any("rllm_skyrl.inference" in p for p in running) and any("Worker" in p for p in running), running
    assert backend.runtime is None and backend not in SkyRLBackend._running
    wait_until(lambda: not _started_parts(before), 60, "the workers and servers to exit")
    assert len(ray_ownership) == 1
