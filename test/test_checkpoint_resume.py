"""Checkpoints, atomic saves and exact resume.

Unit tests drive ``CheckpointManager`` with a stand-in for the SkyRL workers (files on disk, no
Ray). The integration tests use real training subprocesses (see ``training_runs.py``): one run of
4 steps straight, one SIGKILLed while its step-3 checkpoint is written, and its ``auto`` resume.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import descendants, policy_checkpoint_tensors, reap, wait_until
from training_runs import (
    KILL_OVERRIDES,
    Run,
    assert_ok,
    launch,
    train_env,
    train_task_ids_by_step,
    wait,
)

from rllm_skyrl.checkpoint.dirs import LATEST, STATE_FILE, CheckpointError, CheckpointLock
from rllm_skyrl.checkpoint.manager import CheckpointManager
from rllm_skyrl.rollout.sampling import RequestSeeds
from rllm_skyrl.standalone import StatefulTaskDataLoader

# ---------------------------------------------------------------------------- unit: the manager


class FakeWorkers:
    """Writes a file per role the way SkyRL's workers write their checkpoint directory."""

    def __init__(self, roles=("policy", "ref"), fail_on_save: int | None = None):
        self.roles = roles
        self.weights = {role: 0 for role in roles}
        self.loaded: list[tuple[str, str]] = []
        self.saves = 0
        self.fail_on_save = fail_on_save

    def save_checkpoint(self, role: str, ckpt_dir: str) -> None:
        self.saves += 1
        os.makedirs(ckpt_dir, exist_ok=True)
        Path(ckpt_dir, "model.pt").write_text(str(self.weights[role]))
        if self.fail_on_save == self.saves:
            raise KeyboardInterrupt("killed mid-save")

    def load_checkpoint(self, role: str, ckpt_dir: str) -> None:
        self.weights[role] = int(Path(ckpt_dir, "model.pt").read_text())
        self.loaded.append((role, ckpt_dir))


def _state(loader=None, step=0):
    return SimpleNamespace(train_dataloader=loader, global_step=step, epoch=0)


def test_save_writes_roles_state_and_latest_but_not_the_reference(tmp_path):
    workers = FakeWorkers(roles=("policy", "critic", "ref"))
    manager = CheckpointManager(tmp_path, workers.roles)
    loader = StatefulTaskDataLoader([{"id": i} for i in range(10)], batch_size=2, seed=3)
    next(iter(loader))
    path = manager.save(1, _state(loader, 1), workers)
    assert path == tmp_path / "global_step_1"
    assert sorted(p.name for p in path.iterdir()) == ["critic", "policy", STATE_FILE]
    state = json.loads((path / STATE_FILE).read_text())
    assert state["global_step"] == 1 and state["dataloader"] == {"epoch": 0, "cursor": 2, "seed": 3}
    assert (tmp_path / LATEST).read_text() == "global_step_1" and manager.latest_step() == 1
    assert not list(tmp_path.glob(".*"))  # no temporary directory or pointer left behind


def test_a_save_interrupted_midway_leaves_the_previous_checkpoint_and_latest(tmp_path):
    workers = FakeWorkers(roles=("policy", "critic"), fail_on_save=4)  # dies inside the 2nd save
    manager = CheckpointManager(tmp_path, workers.roles)
    manager.save(2, _state(), workers)
    with pytest.raises(KeyboardInterrupt):
        manager.save(4, _state(), workers)
    assert manager.latest_step() == 2 and not (tmp_path / "global_step_4").exists()
    assert [p.name for p in tmp_path.glob(".tmp_global_step_4_*")]  # the orphan is still there...
    workers.fail_on_save = None
    manager.save(4, _state(), workers)
    assert not list(tmp_path.glob(".tmp_*"))  # ...until the next save removes it
    assert manager.latest_step() == 4


def test_resaving_a_step_is_atomic_and_recovers_an_interrupted_swap(tmp_path):
    workers = FakeWorkers(roles=("policy",))
    manager = CheckpointManager(tmp_path, workers.roles)
    workers.weights["policy"] = 1
    manager.save(3, _state(), workers)
    workers.weights["policy"] = 2
    manager.save(3, _state(), workers)  # e.g. after resuming from step 2
    assert (tmp_path / "global_step_3" / "policy" / "model.pt").read_text() == "2"
    assert not list(tmp_path.glob(".old_*"))
    # A kill between moving the old directory aside and renaming the new one in; the next run's claim
    # puts it back:
    os.rename(tmp_path / "global_step_3", tmp_path / ".old_global_step_3_999")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.latest_step()
    CheckpointLock(tmp_path).acquire().release()
    assert manager.latest_step() == 3 and not list(tmp_path.glob(".old_*"))
    assert (tmp_path / "global_step_3" / "policy" / "model.pt").read_text() == "2"


def test_a_dangling_latest_pointer_is_a_clear_error(tmp_path):
    (tmp_path / LATEST).write_text("global_step_7")
    with pytest.raises(CheckpointError, match="global_step_7.*not a complete checkpoint"):
        CheckpointManager(tmp_path, ("policy",)).latest_step()


def test_prune_keeps_the_newest_up_to_the_current_step(tmp_path):
    workers = FakeWorkers(roles=("policy",))
    manager = CheckpointManager(tmp_path, workers.roles, max_to_keep=2)
    for step in (1, 2, 3, 4, 5):
        manager.save(step, _state(), workers)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_4", "global_step_5"]
    manager.save(3, _state(), workers)  # resumed from an older step: later ones are not counted or deleted
    names = sorted(p.name for p in tmp_path.glob("global_step_*"))
    assert names == ["global_step_3", "global_step_4", "global_step_5"] and manager.latest_step() == 3


def test_object_store_paths_are_refused():
    with pytest.raises(ValueError, match="local or shared filesystem"):
        CheckpointManager("s3://bucket/run", ("policy",))


def test_resume_modes(tmp_path, caplog):
    workers = FakeWorkers(roles=("policy",))
    manager = CheckpointManager(tmp_path / "ckpt", workers.roles)
    assert manager.resume("auto", None, _state(), workers) is None  # nothing saved yet: start at step 1
    for step in (2, 4):
        workers.weights["policy"] = step * 10
        manager.save(step, _state(step=step), workers)

    state = _state()
    assert manager.resume("auto", None, state, workers) == 4 and state.global_step == 4
    assert workers.weights["policy"] == 40

    with caplog.at_level(logging.WARNING, logger="rllm_skyrl.checkpoint.manager"):
        assert manager.resume("disable", None, _state(), workers) is None
    assert "resume_mode=disable" in caplog.text and "up to step 4" in caplog.text

    state = _state()
    assert manager.resume("resume_path", str(tmp_path / "ckpt" / "global_step_2"), state, workers) == 2
    assert state.global_step == 2 and workers.weights["policy"] == 20
    assert manager.resume("resume_path", str(tmp_path / "ckpt"), _state(), workers) == 4  # a root: its latest

    with pytest.raises(FileNotFoundError, match="resume_from_path=.*not a checkpoint"):
        manager.resume("resume_path", str(tmp_path / "nowhere"), _state(), workers)
    with pytest.raises(ValueError, match="resume_mode='sometimes'"):
        manager.resume("sometimes", None, _state(), workers)
    critic = CheckpointManager(tmp_path / "ckpt", ("policy", "critic"))
    with pytest.raises(CheckpointError, match="no critic checkpoint"):
        critic.resume("auto", None, _state(), FakeWorkers(roles=("policy", "critic")))


def test_resume_restores_the_data_position_and_rng(tmp_path):
    rows = [{"id": i} for i in range(12)]
    reference = StatefulTaskDataLoader(rows, batch_size=3, seed=5)
    order = [[r["id"] for r in batch] for _ in range(2) for batch in reference]  # two epochs

    loader = StatefulTaskDataLoader(rows, batch_size=3, seed=5)
    batches = iter(loader)
    seen = [[r["id"] for r in next(batches)] for _ in range(3)]
    workers = FakeWorkers(roles=("policy",))
    manager = CheckpointManager(tmp_path, workers.roles)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    manager.save(3, _state(loader, 3), workers)
    expected_rng = (random.random(), np.random.rand(), torch.rand(1).item())

    fresh = StatefulTaskDataLoader(rows, batch_size=3, seed=5)
    manager.resume("auto", None, _state(fresh), workers)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_rng
    rest = [[r["id"] for r in batch] for _ in range(2) for batch in fresh]
    assert seen + rest == order  # none repeated, none skipped, across the epoch boundary


def test_request_seeds_depend_on_what_is_asked_not_on_history():
    a, b = RequestSeeds(), RequestSeeds()
    seeds_a = [a.next(42, 0, [1, 2, 3], False) for _ in range(3)]
    assert len(set(seeds_a)) == 3  # repeats of one prompt sample differently
    b.next(42, 0, [9, 9], False)  # other prompts and validation requests do not shift the sequence
    b.next(42, 0, [1, 2, 3], True)
    assert [b.next(42, 0, [1, 2, 3], False) for _ in range(3)] == seeds_a
    # a new policy version starts fresh, in every run alike
    assert a.next(42, 1, [1, 2, 3], False) == b.next(42, 1, [1, 2, 3], False) not in seeds_a
    assert all(0 <= s < 2**63 for s in seeds_a)


def test_a_rollouts_seed_follows_its_rollout_id_whatever_order_requests_arrive_in():
    """rLLM's workflow engine starts a step's rollouts as concurrent tasks: two tasks with the same
    prompt, rolled out 4 times each, reach the server in any order, and each rollout still gets the
    seed it gets in another run; a task's rollouts count up from one base (one ``sample`` call)."""

    def seeds(order):
        request_seeds = RequestSeeds()
        return {uid: request_seeds.next(7, 0, [5, 6], False, uid) for uid in order}

    uids = [f"{task}:{index}" for task in ("t24", "t28") for index in range(4)]
    first, shuffled = seeds(uids), seeds(list(reversed(uids[4:])) + uids[2:4] + uids[:2])
    assert first == shuffled
    for task in ("t24", "t28"):
        assert [first[f"{task}:{i}"] - first[f"{task}:0"] for i in range(4)] == [0, 1, 2, 3]
    assert first["t24:0"] != first["t28:0"]  # the same prompt, another task: its own samples
    request_seeds = RequestSeeds()
    again = [request_seeds.next(7, 0, [5, 6], False, "t24:1") for _ in range(2)]
    assert again[0] == first["t24:1"] and again[1] not in first.values()  # a repeated turn: fresh


# ---------------------------------------------------------------------------- unit: backend hooks


def _backend(tmp_path, save_freq=2):
    from omegaconf import OmegaConf

    from rllm_skyrl.backend import SkyRLBackend
    from rllm_skyrl.run_config import CheckpointSettings, InferenceSettings, LoraSettings

    backend = SkyRLBackend(OmegaConf.create({}))
    backend.run = SimpleNamespace(
        checkpoint=CheckpointSettings(root=tmp_path, save_freq=save_freq),
        inference=InferenceSettings(),
        lora=LoraSettings(),
        async_training=False,
    )
    backend.checkpoints = CheckpointManager(tmp_path, ("policy",))
    backend.runtime = SimpleNamespace(workers=FakeWorkers(roles=("policy",)), startup_metrics=dict)

    async def no_sync(version):
        backend.synced = version

    backend._sync_weights = no_sync
    return backend


def test_a_failing_step_is_neither_published_nor_checkpointed(tmp_path, caplog):
    backend = _backend(tmp_path)
    state = SimpleNamespace(global_step=2, epoch=0, metrics={}, train_dataloader=None)

    async def failing_step():
        backend._updated = True
        try:
            raise RuntimeError("worker gone")
        finally:
            await backend.on_batch_end(state)  # the driver calls it from ``finally``

    with pytest.raises(RuntimeError), caplog.at_level(logging.ERROR):
        try:
            asyncio.run(failing_step())
        except RuntimeError:
            asyncio.run(backend.on_train_end(state))  # called while the failure propagates
            raise
    assert not (tmp_path / "global_step_2").exists() and not hasattr(backend, "synced")
    assert "training stopped at step 2: RuntimeError: worker gone" in caplog.text
    assert "no checkpoint was saved" in caplog.text


def test_completed_steps_checkpoint_on_schedule_and_at_the_end(tmp_path):
    backend = _backend(tmp_path, save_freq=2)
    state = SimpleNamespace(global_step=0, epoch=0, metrics={}, train_dataloader=None)

    async def run(steps):
        for step in steps:
            state.global_step = step
            backend._updated = step != 3  # step 3: an empty batch, no update
            await backend.on_batch_end(state)
        await backend.on_train_end(state)

    asyncio.run(run([1, 2, 3]))
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert backend.checkpoints.latest_step() == 3 and backend.synced == 2


def test_an_exception_around_fit_is_not_taken_for_a_failed_step(tmp_path):
    backend = _backend(tmp_path, save_freq=1)
    backend.checkpoints.resume = lambda **_: None
    state = SimpleNamespace(global_step=1, epoch=0, metrics={}, train_dataloader=None)
    backend.rollout_engine = None

    async def fit():
        await backend.on_train_start(state)
        backend._updated = True
        await backend.on_batch_end(state)

    try:
        raise ValueError("a retry wrapper calls fit() from an except block")
    except ValueError:
        asyncio.run(fit())
    assert backend.checkpoints.latest_step() == 1


def test_what_is_alive_when_training_starts_is_left_out_of_later_collections(tmp_path):
    """Full collections walk only what the run creates after its start, not all of torch."""
    backend = _backend(tmp_path, save_freq=1)
    backend.checkpoints.resume = lambda **_: None
    state = SimpleNamespace(global_step=1, epoch=0, metrics={}, train_dataloader=None)
    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        asyncio.run(backend.on_train_start(state))
        assert gc.get_freeze_count() > 10_000  # the modules, classes and functions loaded so far
    finally:
        gc.unfreeze()


# ---------------------------------------------------------------------------- real runs


@pytest.mark.slow
def test_checkpoints_hold_weights_optimizer_data_position_and_rng(digits_runs):
    straight = digits_runs.straight
    assert_ok(straight)
    ckpt = straight.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == ["global_step_2", "global_step_4"]
    assert (ckpt / LATEST).read_text() == "global_step_4"
    for step in (2, 4):
        policy = ckpt / f"global_step_{step}" / "policy"
        for name in ("model", "optim", "extra_state"):
            assert (policy / f"{name}_world_size_1_rank_0.pt").stat().st_size > 0
        state = json.loads((ckpt / f"global_step_{step}" / STATE_FILE).read_text())
        # 4 tasks per step: after step N the loader's next batch starts at row 4N
        assert state["global_step"] == step and state["dataloader"]["cursor"] == 4 * step
        assert {"python", "numpy", "torch"} <= set(state["rng"])
    tensors = policy_checkpoint_tensors(ckpt / "global_step_4")
    assert any(k.endswith("exp_avg_sq") for k in tensors), "optimizer moments are not in the checkpoint"
    early, late = policy_checkpoint_tensors(ckpt / "global_step_2"), tensors
    assert any(not torch.equal(early[k], late[k]) for k in early if k.startswith("model/"))


@pytest.mark.slow
def test_sigkill_during_a_save_keeps_the_previous_checkpoint(digits_runs):
    kill = digits_runs.kill
    assert digits_runs.killed.returncode == -signal.SIGKILL
    assert kill.tmp_dir.startswith(".tmp_global_step_3_")
    assert kill.tmp_contents == ["policy", STATE_FILE], "the run was killed before its save was complete"
    assert kill.latest_after == "global_step_2"
    assert "global_step_3" not in kill.listing_after, f"the interrupted save was published: {kill}"
    assert {"global_step_1", "global_step_2"} <= set(kill.listing_after)
    assert kill.leftover_pids == [], "processes of the killed run outlived it by a minute"


@pytest.mark.slow
def test_auto_resume_after_the_kill_matches_the_uninterrupted_run(digits_runs):
    straight, killed, resumed = digits_runs.straight, digits_runs.killed, digits_runs.resumed
    assert_ok(straight)
    assert_ok(resumed)
    assert "resumed from" in resumed.text and "global_step_2 (step 2)" in resumed.text

    # Same data order: steps 1-2 from the killed run plus 3-4 from the resumed one == straight 1-4.
    expected = train_task_ids_by_step(straight.rollouts())
    before, after = train_task_ids_by_step(killed.rollouts()), train_task_ids_by_step(resumed.rollouts())
    assert sorted(expected) == [1, 2, 3, 4]
    assert {s: before[s] for s in (1, 2)} | after == expected
    assert before[3] == after[3]  # the step lost in the kill was redone on the same batch
    all_ids = [task for step in (1, 2, 3, 4) for task in expected[step]]
    assert len(all_ids) == len(set(all_ids)) == 16  # no batch repeated or skipped

    # One history in metrics.jsonl: every step exactly once.
    assert [r["progress/batch"] for r in resumed.metrics() if "progress/batch" in r] == [1, 2, 3, 4]
    assert not list((resumed.run_dir / "checkpoints").glob(".tmp_*"))  # the orphan was cleaned up

    # Bit-identical weights and optimizer state after step 4: the training worker is deterministic,
    # and the test app's server decodes each row alone, so both runs sampled identical log-probs.
    a = policy_checkpoint_tensors(straight.run_dir / "checkpoints" / "global_step_4")
    b = policy_checkpoint_tensors(resumed.run_dir / "checkpoints" / "global_step_4")
    assert a.keys() == b.keys()
    differing = {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not differing, f"resumed state differs from the straight run's: {differing}"
    step_2 = policy_checkpoint_tensors(straight.run_dir / "checkpoints" / "global_step_2")
    assert any(not torch.equal(a[k], v) for k, v in step_2.items() if k.startswith("model/"))  # it trained


# ---------------------------------------------------------------------------- slow: failures


def _policy_worker(pid: int, method: str | None = None) -> list:
    found = []
    for process in descendants(pid):
        try:
            title = " ".join(process.cmdline())
        except Exception:
            continue
        if "PolicyWorker" in title and (method is None or f".{method}" in title):
            found.append(process)
    return found


@pytest.mark.slow
def test_a_killed_worker_fails_the_run_clearly_and_auto_resume_continues(tmp_path):
    run = Run(tmp_path / "run", tmp_path / "first.out", tmp_path / "first_rollouts.jsonl")
    overrides = [
        "rllm.trainer.total_batches=8",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.val_before_train=false",
    ]
    env = train_env(run.run_dir)
    started = time.monotonic()
    process = launch(run, overrides, env)
    latest = run.run_dir / "checkpoints" / LATEST

    def busy_policy_worker():  # once step 2 is saved: the policy worker, inside a forward_backward
        assert process.poll() is None, f"the run ended first:\n{run.text[-4000:]}"
        return latest.exists() and _policy_worker(process.pid, "forward_backward")

    victim = wait_until(busy_policy_worker, 600, "a policy worker in forward_backward after step 2")
    tree = descendants(process.pid)
    victim[0].kill()
    killed_at = time.monotonic()
    try:
        process.wait(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"the run hung after its worker died:\n{run.text[-4000:]}") from None
    reap(tree, timeout=60)
    seconds_to_fail = time.monotonic() - killed_at
    assert process.returncode != 0
    text = run.text
    assert "a SkyRL training worker died" in text and "resume_mode=auto" in text, text[-4000:]
    saved = latest.read_text().strip()

    again = Run(run.run_dir, tmp_path / "second.out", tmp_path / "second_rollouts.jsonl")
    wait(again, launch(again, overrides, env), time.monotonic())
    assert_ok(again)
    assert f"resumed from {run.run_dir / 'checkpoints' / saved}" in again.text
    assert [r["progress/batch"] for r in again.metrics() if "progress/batch" in r] == list(range(1, 9))
    total = time.monotonic() - started
    print(f"failed {seconds_to_fail:.1f} s after the kill; resumed from {saved}; {total:.0f} s in all")


@pytest.mark.slow
def test_resume_path_and_disable_in_real_runs(tmp_path, digits_runs):
    """Starts from a copy of the shared killed/resumed run's checkpoints (steps 1-4, saved every step):
    ``resume_path`` branches from step 1 and redoes steps 2-4 to the same weights; ``disable`` then
    starts over at step 1 in the same directory."""
    first = Run(tmp_path / "run", tmp_path / "a.out", tmp_path / "a.jsonl")
    ckpt = first.run_dir / "checkpoints"
    shutil.copytree(digits_runs.resumed.run_dir / "checkpoints", ckpt)
    assert (ckpt / LATEST).read_text() == "global_step_4"
    env = train_env(first.run_dir)
    before = policy_checkpoint_tensors(ckpt / "global_step_4")

    branch = Run(first.run_dir, tmp_path / "b.out", tmp_path / "b.jsonl")
    overrides = [*KILL_OVERRIDES, "rllm.trainer.total_batches=4", "training.resume_mode=resume_path"]
    overrides.append(f"training.resume_from_path={ckpt / 'global_step_1'}")
    wait(branch, launch(branch, overrides, env), time.monotonic())
    assert_ok(branch)
    assert "global_step_1 (step 1)" in branch.text
    assert sorted(train_task_ids_by_step(branch.rollouts())) == [2, 3, 4]  # steps 2 to 4 again
    after = policy_checkpoint_tensors(ckpt / "global_step_4")  # re-saved in place
    assert max((before[k] - after[k]).abs().max().item() for k in before) < 1e-6
    assert (ckpt / LATEST).read_text() == "global_step_4" and not list(ckpt.glob(".old_*"))

    fresh = Run(first.run_dir, tmp_path / "c.out", tmp_path / "c.jsonl")
    overrides = [*KILL_OVERRIDES, "rllm.trainer.total_batches=1", "training.resume_mode=disable"]
    wait(fresh, launch(fresh, overrides, env), time.monotonic())
    assert_ok(fresh)
    assert "resume_mode=disable: starting from step 1" in fresh.text
    assert sorted(train_task_ids_by_step(fresh.rollouts())) == [1]
    assert [r["step"] for r in fresh.metrics()] == [1]
    assert (ckpt / LATEST).read_text() == "global_step_1"
