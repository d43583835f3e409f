"""Faults during real runs: each ends in a clear error, loses no checkpoint, leaves no process, and
``training.resume_mode=auto`` then finishes the run at the same data position.

Two faults live here (the inference server killed mid-rollout, the checkpoint disk full mid-save),
and the driver stopped by SIGTERM or Ctrl-C; a training worker killed mid-step and the driver
SIGKILLed mid-save are in test_checkpoint_resume.py.

The run stopped by SIGTERM trains ``STEPS`` steps first: those steps are the reference (the data
order of a run that never failed) both faults are compared with, so no run is spent on it alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
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


# How long Ray, its workers and the inference servers may take to go after a stop signal: generous,
# so a busy machine passes; a process that ignores the stop stays forever and still fails it.
STOP_SECONDS = 60


@dataclass
class Stopped:
    """A run stopped by a signal after ``steps`` steps: how it ended and what it left behind."""

    run: Run
    code: int
    seconds: float
    leftovers: list[str]


def _stop_mid_run(tmp_path: Path, how: str, steps: int) -> Stopped:
    """Launch a run far longer than ``steps``, send ``how`` once ``steps`` steps are recorded, and
    wait for the driver and every process it started to go."""
    run = Run(tmp_path / "run", tmp_path / "run.out", tmp_path / "rollouts.jsonl")
    process = launch(run, [*OVERRIDES, "rllm.trainer.total_batches=100"], train_env(run.run_dir))
    metrics = run.run_dir / "metrics.jsonl"

    def recorded() -> bool:
        return metrics.exists() and len(metrics.read_text().splitlines()) >= steps

    _wait_for(recorded, process, run, f"step {steps}")
    tree = [psutil.Process(process.pid), *descendants(process.pid)]
    assert len(tree) > 3, tree  # Ray's daemons, its workers and the server are running
    names = {p.pid: " ".join(p.cmdline())[:120] for p in tree}
    sent = time.monotonic()
    process.send_signal(getattr(signal, how))
    try:
        code = process.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        reap(tree[1:], timeout=30)
        late = f"the driver still ran {STOP_SECONDS} s after {how}"
        raise AssertionError(f"{late}:\n{run.text[-3000:]}") from None
    left = reap(tree[1:], timeout=max(0.0, sent + STOP_SECONDS - time.monotonic()))
    return Stopped(run, code, time.monotonic() - sent, [names[pid] for pid in left])


@pytest.fixture(scope="module")
def stopped_by_sigterm(tmp_path_factory) -> Stopped:
    """One run, SIGTERMed after ``STEPS`` steps: the stop test's subject and the faults' reference."""
    return _stop_mid_run(tmp_path_factory.mktemp("sigterm"), "SIGTERM", STEPS)


@pytest.fixture(scope="module")
def clean_task_ids(stopped_by_sigterm) -> dict[int, list]:
    """The task ids of steps 1..STEPS of a run that no fault touched (same overrides, same data)."""
    by_step = train_task_ids_by_step(stopped_by_sigterm.run.rollouts())
    assert all(step in by_step for step in range(1, STEPS + 1)), sorted(by_step)
    return {step: by_step[step] for step in range(1, STEPS + 1)}


def _fail_then_resume(
    tmp_path: Path,
    run_dir: Path,
    fault,
    expected: str,
    ckpt: Path,
    reference: dict,
    before_resume=None,
    failing_overrides: tuple[str, ...] = (),
) -> None:
    """Launch (with ``failing_overrides`` too), let ``fault(process, run)`` strike, check the failure,
    resume and compare with a run that never failed (``reference``: same data, same order)."""
    first = Run(run_dir, tmp_path / "first.out", tmp_path / "first.jsonl")
    env = train_env(run_dir)
    process = launch(first, [*OVERRIDES, *failing_overrides], env)
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

    # Each of rLLM's attempts at a rollout spends SkyRL's client's ~30 s of connection retries on the
    # dead server; one attempt shows the same failure as its default three.
    _fail_then_resume(
        tmp_path,
        run_dir,
        kill_server,
        "inference server 0",
        ckpt,
        clean_task_ids,
        failing_overrides=("rllm.workflow.retry_limit=1",),
    )


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


def _assert_stopped_cleanly(stopped: Stopped, how: str) -> None:
    text = stopped.run.text
    assert not stopped.leftovers, f"alive {STOP_SECONDS} s after {how}: {stopped.leftovers}\n{text[-3000:]}"
    # It unwound (servers, workers and Ray stopped by the run itself), not died of the signal.
    said = "SIGTERM" if how == "SIGTERM" else "Ctrl-C"
    assert stopped.code == (143 if how == "SIGTERM" else 130), text[-3000:]
    assert f"stopped by {said}" in text and "Traceback" not in text, text[-3000:]
    print(f"{how}: the run and every process it started were gone after {stopped.seconds:.1f} s")


@pytest.mark.timeout(900)
def test_a_run_stopped_by_sigterm_leaves_no_process(stopped_by_sigterm):
    """``kill <driver>`` mid-run: Ray, its workers and the inference servers go with it."""
    _assert_stopped_cleanly(stopped_by_sigterm, "SIGTERM")


@pytest.mark.timeout(900)
def test_a_run_stopped_by_ctrl_c_leaves_no_process(tmp_path):
    """Ctrl-C (SIGINT) after the first step: the same clean unwinding as SIGTERM."""
    _assert_stopped_cleanly(_stop_mid_run(tmp_path, "SIGINT", 1), "SIGINT")
