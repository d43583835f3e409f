"""Real training runs in subprocesses, shared by the checkpoint/resume and validation/metrics tests.

``shared_digits_runs`` starts two runs of ``apps/train_digits.py`` at once and a third after:

    straight   4 steps in one go (validation before training and every 2 steps, secrets)
    killed     the same training, checkpointing every step, SIGKILLed (with every process it
               started) while its step-3 checkpoint is written but not yet published
    resumed    ``training.resume_mode=auto`` in the killed run's directory: steps 3 and 4

Every run gets secrets in its environment and config, so the secret checks cover all three.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from helpers import descendants, reap, wait_until

APP = Path(__file__).resolve().parent / "apps" / "train_digits.py"
REPO = APP.parents[2]
SECRETS = {
    "WANDB_API_KEY": "wandbsecret" + "0123456789abcdef0123456789abcdef",
    "HF_TOKEN": "hf_secret_" + "ZYXWVUTSRQPONMLK",
}
CONFIG_SECRET = "cfgsecret-" + "s3cr3t-v4lu3-1234"
SECRET_OVERRIDES = [f"+credentials.api_key={CONFIG_SECRET}", "+auth.header=${oc.env:HF_TOKEN}"]
RUN_TIMEOUT = 600


@dataclass
class Run:
    run_dir: Path
    output: Path
    rollout_log: Path
    returncode: int | None = None
    seconds: float = 0.0

    @property
    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def metrics(self) -> list[dict]:
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def rollouts(self) -> list[dict]:
        return [json.loads(line) for line in self.rollout_log.read_text().splitlines() if line.strip()]


@dataclass
class KillReport:
    tmp_dir: str  # the temporary checkpoint directory that existed when the kill was sent
    tmp_contents: list[str]
    latest_after: str
    listing_after: list[str]
    leftover_pids: list[int] = field(default_factory=list)


@dataclass
class SharedRuns:
    straight: Run
    killed: Run
    resumed: Run
    kill: KillReport


def train_env(run_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        **SECRETS,
        "RLLM_SKYRL_CACHE": os.environ.get("RLLM_SKYRL_CACHE", str(REPO / ".cache")),
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CACHE_DIR": str(run_dir.parent / "wandb_cache"),
        "WANDB_CONFIG_DIR": str(run_dir.parent / "wandb_config"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra)
    return env


def launch(run: Run, overrides: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start a training process in its own session, so the whole tree can be killed at once."""
    command = [sys.executable, str(APP), f"hydra.run.dir={run.run_dir}", *overrides]
    with open(run.output, "ab") as out:
        return subprocess.Popen(
            command,
            cwd=REPO,
            env={**env, "ROLLOUT_LOG": str(run.rollout_log)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_ctrl_c_as_from_a_terminal,
        )


def _ctrl_c_as_from_a_terminal() -> None:
    """In the child, before exec: Ctrl-C at its default, as a terminal starts a program. A suite
    started in the background (``cmd &`` in a script, where a shell ignores SIGINT for it) passes
    the ignored SIGINT on to every run it starts, and a run then rightly ignores Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait(run: Run, process: subprocess.Popen, started: float, timeout: float = RUN_TIMEOUT) -> Run:
    tree = descendants(process.pid)
    try:
        run.returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = descendants(process.pid) + [psutil.Process(process.pid)]
        os.killpg(process.pid, signal.SIGKILL)
        reap(tree, timeout=10)
        raise AssertionError(f"{run.run_dir} did not finish in {timeout} s:\n{run.text[-4000:]}") from None
    reap(tree, timeout=30)
    run.seconds = time.monotonic() - started
    return run


def kill_during_save(
    run: Run, process: subprocess.Popen, marker: Path, timeout: float = RUN_TIMEOUT
) -> KillReport:
    """SIGKILL the run's process group while it holds a save (see ``HOLD_SAVE_AT_STEP``).

    The run writes ``marker`` once the save is complete on disk but not yet published, and waits
    there; the kill therefore always lands at that point, whatever the machine's speed.
    """
    checkpoints = run.run_dir / "checkpoints"
    try:
        wait_until(lambda: marker.exists() or process.poll() is not None, timeout, "the held save")
    except AssertionError:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"no held save within {timeout} s:\n{run.text[-4000:]}") from None
    if not marker.exists():
        raise AssertionError(f"run ended before its held save:\n{run.text[-4000:]}")
    tree = descendants(process.pid)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    leftovers = reap(tree, timeout=60)  # Ray workers live in their own sessions; they exit on their own
    run.returncode = process.returncode
    tmp = checkpoints / marker.read_text()
    return KillReport(
        tmp_dir=tmp.name,
        tmp_contents=sorted(os.listdir(tmp)) if tmp.exists() else [],
        latest_after=(checkpoints / "latest").read_text().strip(),
        listing_after=sorted(os.listdir(checkpoints)),
        leftover_pids=leftovers,
    )


COMMON_OVERRIDES = ["rllm.trainer.logger=[console]", *SECRET_OVERRIDES]
# The killed/resumed pair checkpoints every step and never validates; sampling is seeded per
# request, so validation in the straight run must not change what training samples.
KILL_OVERRIDES = [
    *COMMON_OVERRIDES,
    "rllm.trainer.save_freq=1",
    "rllm.trainer.test_freq=0",
    "rllm.trainer.val_before_train=false",
]


def shared_digits_runs(root: Path) -> SharedRuns:
    straight = Run(root / "straight", root / "straight.out", root / "straight_rollouts.jsonl")
    killed = Run(root / "killed", root / "killed.out", root / "killed_rollouts.jsonl")
    resumed = Run(root / "killed", root / "resumed.out", root / "resumed_rollouts.jsonl")
    verbose = {"RLLM_SKYRL_LOG_LEVEL": "INFO"}  # SkyRL logs forwarded env vars (values included) at INFO

    started = time.monotonic()
    straight_process = launch(straight, COMMON_OVERRIDES, train_env(straight.run_dir))
    marker = root / "killed.held_save"
    hold = {"HOLD_SAVE_AT_STEP": "3", "HOLD_SAVE_MARKER": str(marker)}
    killed_process = launch(killed, KILL_OVERRIDES, train_env(killed.run_dir, **verbose, **hold))
    try:
        kill = kill_during_save(killed, killed_process, marker)
    finally:
        if killed_process.poll() is None:
            os.killpg(killed_process.pid, signal.SIGKILL)
    resumed_started = time.monotonic()
    resumed_process = launch(resumed, KILL_OVERRIDES, train_env(resumed.run_dir, **verbose))
    wait(straight, straight_process, started)
    wait(resumed, resumed_process, resumed_started)
    return SharedRuns(straight=straight, killed=killed, resumed=resumed, kill=kill)


def train_task_ids_by_step(rollouts: list[dict]) -> dict[int, list[str]]:
    """Training step -> the sorted task ids it rolled out (step N samples from weight version N-1)."""
    by_step: dict[int, set[str]] = defaultdict(set)
    for record in rollouts:
        if not record["val"]:
            by_step[record["version"] + 1].add(record["task_id"])
    return {step: sorted(ids) for step, ids in sorted(by_step.items())}


def assert_ok(run: Run) -> None:
    assert run.returncode == 0, f"{run.run_dir} exited with {run.returncode}:\n{run.text[-4000:]}"
