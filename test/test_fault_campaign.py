"""Faults during real runs: each ends in a clear error, loses no checkpoint, leaves no process, and
``training.resume_mode=auto`` then finishes the run at the same data position.

Two faults live here (the inference server killed mid-rollout, the checkpoint disk full mid-save);
a training worker killed mid-step and the driver SIGKILLed mid-save are in test_checkpoint_resume.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from training_runs import Run, assert_ok, descendants, launch, reap, train_env, train_task_ids_by_step, wait

from rllm_skyrl.checkpoint.dirs import LATEST

pytestmark = pytest.mark.slow
STEPS = 6
OVERRIDES = [
    f"rllm.trainer.total_batches={STEPS}",
    "rllm.trainer.test_freq=0",
    "rllm.trainer.val_before_train=false",
    "rllm.trainer.save_freq=1",
    "inference.deterministic_sampling=true",
]


def _wait_for(predicate, process: subprocess.Popen, run: Run, what: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert process.poll() is None, f"the run ended before {what}:\n{run.text[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s:\n{run.text[-4000:]}"
        time.sleep(0.05)
    return found


@pytest.fixture(scope="module")
def clean_task_ids(tmp_path_factory) -> dict[int, list]:
    """The task ids of every step of a run that never failed, shared by the faults below."""
    tmp_path = tmp_path_factory.mktemp("clean")
    clean = Run(tmp_path / "run", tmp_path / "clean.out", tmp_path / "clean.jsonl")
    wait(clean, launch(clean, OVERRIDES, train_env(clean.run_dir)), time.monotonic())
    assert_ok(clean)
    return train_task_ids_by_step(clean.rollouts())


def _fail_then_resume(
    tmp_path: Path, run_dir: Path, fault, expected: str, ckpt: Path, reference: dict, before_resume=None
) -> None:
    """Launch, let ``fault(process, run)`` strike, check the failure, resume and compare with a run
    that never failed (``reference``: same data, same order)."""
    first = Run(run_dir, tmp_path / "first.out", tmp_path / "first.jsonl")
    env = train_env(run_dir)
    process = launch(first, OVERRIDES, env)
    tree = fault(process, first)
    try:
        process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"the run hung after the fault:\n{first.text[-4000:]}") from None
    leftovers = reap(tree + descendants(process.pid), timeout=30)
    assert process.returncode != 0 and expected in first.text, first.text[-4000:]
    assert "resume_mode=auto" in first.text, first.text[-4000:]
    assert not leftovers, f"processes left behind: {leftovers}"
    saved = (ckpt / LATEST).read_text().strip() if (ckpt / LATEST).exists() else "global_step_0"
    if saved != "global_step_0":
        assert (ckpt / saved / "trainer_state.json").exists()  # the last complete checkpoint is intact
    if before_resume is not None:
        before_resume()

    again = Run(run_dir, tmp_path / "again.out", tmp_path / "again.jsonl")
    wait(again, launch(again, OVERRIDES, env), time.monotonic())
    assert_ok(again)
    resumed_after = int(saved.removeprefix("global_step_"))
    steps = [r["progress/batch"] for r in again.metrics() if "progress/batch" in r]
    assert steps == list(range(1, STEPS + 1))
    # The same data, in the same order, as a run that never failed.
    resumed = train_task_ids_by_step(again.rollouts())
    assert sorted(resumed) == list(range(resumed_after + 1, STEPS + 1))
    assert all(resumed[step] == reference[step] for step in resumed)


def _server_processes(pid: int) -> list[psutil.Process]:
    return [p for p in descendants(pid) if "rllm_skyrl.inference" in " ".join(p.cmdline())]


@pytest.mark.timeout(1800)
def test_inference_server_killed_mid_rollout(tmp_path, clean_task_ids):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"

    def kill_server(process, run):
        _wait_for(lambda: (ckpt / LATEST).exists(), process, run, "a first checkpoint")
        (server,) = _wait_for(lambda: _server_processes(process.pid), process, run, "the inference server")
        tree = descendants(process.pid)
        server.kill()
        return tree

    _fail_then_resume(tmp_path, run_dir, kill_server, "inference server 0", ckpt, clean_task_ids)


@pytest.mark.timeout(1800)
def test_checkpoint_disk_full_mid_save(tmp_path, clean_task_ids):
    """The checkpoint directory on a tmpfs with room for about one checkpoint (1.6 MB each)."""
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    ckpt.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(ckpt)], capture_output=True
    )
    assert mounted.returncode == 0, f"cannot mount a small tmpfs here: {mounted.stderr!r}"
    try:
        _fail_then_resume(
            tmp_path,
            run_dir,
            lambda process, run: descendants(process.pid),  # the fault is the disk itself
            "is full",
            ckpt,
            clean_task_ids,
            before_resume=lambda: subprocess.run(["mount", "-o", "remount,size=256m", str(ckpt)], check=True),
        )
        assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp_")]  # no half-written save left
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], capture_output=True)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_stopped_run_leaves_no_process_within_10_s(tmp_path, how):
    """``kill <driver>`` or Ctrl-C mid-run: Ray, its workers and the inference servers go with it."""
    run = Run(tmp_path / "run", tmp_path / "run.out", tmp_path / "rollouts.jsonl")
    process = launch(run, [*OVERRIDES, "rllm.trainer.total_batches=100"], train_env(run.run_dir))
    metrics = run.run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().strip(), process, run, "the first step")
    tree = [psutil.Process(process.pid), *descendants(process.pid)]
    assert len(tree) > 3, tree  # Ray's daemons, its workers and the server are running
    names = {p.pid: " ".join(p.cmdline())[:120] for p in tree}
    process.send_signal(getattr(signal, how))
    deadline = time.monotonic() + 10
    code = process.wait(timeout=10)
    leftovers = [names[pid] for pid in reap(tree[1:], timeout=max(0.0, deadline - time.monotonic()))]
    assert not leftovers, f"alive 10 s after {how}: {leftovers}\n{run.text[-3000:]}"
    # It unwound (servers, workers and Ray stopped by the run itself), not died of the signal.
    said = "SIGTERM" if how == "SIGTERM" else "Ctrl-C"
    assert code == (143 if how == "SIGTERM" else 130), run.text[-3000:]
    assert f"stopped by {said}" in run.text and "Traceback" not in run.text, run.text[-3000:]
