"""One run per checkpoint directory, and a resume that is checked before anything starts.

``CheckpointManager`` with files on disk (no Ray): the lock, which temporary directories a save may
remove, and every way a checkpoint can be broken, each an error naming the file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from rllm_skyrl.checkpoint.dirs import LATEST, STATE_FILE, CheckpointError, CheckpointLock, validate
from rllm_skyrl.checkpoint.manager import CheckpointManager


class DiskWorkers:
    roles = ("policy",)

    def save_checkpoint(self, role: str, ckpt_dir: str) -> None:
        os.makedirs(ckpt_dir, exist_ok=True)
        Path(ckpt_dir, "model.pt").write_text("weights")

    def load_checkpoint(self, role: str, ckpt_dir: str) -> None:
        pass


def saved(root: Path, step: int = 2) -> CheckpointManager:
    manager = CheckpointManager(root, DiskWorkers.roles)
    manager.save(step, SimpleNamespace(train_dataloader=None, global_step=step, epoch=0), DiskWorkers())
    return manager


HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from rllm_skyrl.checkpoint.dirs import CheckpointLock
    lock = CheckpointLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(120)
    """
)


def test_a_second_run_on_the_same_directory_is_refused_naming_the_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            CheckpointError, match=rf"{tmp_path} is in use by another run \(PID {holder.pid}\)"
        ):
            CheckpointLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    CheckpointLock(tmp_path).acquire().release()  # the lock died with its holder


def test_a_save_removes_only_its_own_or_dead_processes_temporaries(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = tmp_path / f".tmp_global_step_3_{os.getpid()}"
        live = tmp_path / f".tmp_global_step_3_{alive.pid}"
        dead = tmp_path / ".tmp_global_step_3_999999"
        for path in (mine, live, dead):
            path.mkdir(parents=True)
        saved(tmp_path)
        assert not mine.exists() and not dead.exists()
        assert live.exists()  # another live process's save in progress is left alone
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda root: (root / LATEST).write_text("global_step_x"), r"latest holds 'global_step_x'"),
        (lambda root: (root / LATEST).write_text("global_step_9"), r"names 'global_step_9'.*not a complete"),
        (
            lambda root: (root / "global_step_2" / STATE_FILE).write_text('{"global_st'),
            r"trainer_state.json is unreadable",
        ),
        (
            lambda root: (root / "global_step_2" / STATE_FILE).write_text(
                json.dumps({"global_step": 2, "roles": []})
            ),
            r"trainer_state.json: 'rng' is missing",
        ),
        (
            lambda root: __import__("shutil").rmtree(root / "global_step_2" / "policy"),
            r"has no policy checkpoint",
        ),
        (lambda root: os.chmod(root / "global_step_2" / "policy" / "model.pt", 0o666), r"writable by others"),
    ],
    ids=[
        "pointer-garbage",
        "pointer-dangling",
        "state-torn",
        "state-no-rng",
        "role-missing",
        "world-writable",
    ],
)
def test_a_broken_checkpoint_is_named_before_anything_loads(tmp_path, break_it, message):
    manager = saved(tmp_path)
    break_it(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        validate(manager.root, manager.roles, "auto", None)


def test_validate_needs_no_workers(tmp_path):
    saved(tmp_path, step=4)
    assert validate(tmp_path, ("policy",), "auto", None) == tmp_path / "global_step_4"


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, caplog):
    from rllm_skyrl.run.metrics_file import MetricsFile, read_metrics

    file = MetricsFile(tmp_path)
    file.append(1, {"reward/mean": 0.5})
    with file.path.open("a") as handle:
        handle.write('{"step": 2, "reward/me')  # the run was killed mid-write
    assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": 0.5}]
    assert "torn last line" in caplog.text
    file.keep_through(1)
    file.append(2, {"reward/mean": 0.75})
    assert [record["step"] for record in read_metrics(tmp_path)] == [1, 2]


def test_runtime_shutdown_stops_every_part_even_when_one_fails():
    from rllm_skyrl.runtime import Runtime

    stopped = []

    class Servers:
        def stop(self):
            stopped.append("servers")
            raise RuntimeError("server stop failed")

    class Workers:
        def shutdown(self):
            stopped.append("workers")

    runtime = Runtime.__new__(Runtime)
    runtime.servers, runtime.workers, runtime.models, runtime.owns_ray = Servers(), Workers(), object(), False
    with pytest.raises(RuntimeError, match="server stop failed"):
        runtime.shutdown()
    assert stopped == ["servers", "workers"] and runtime.workers is None and runtime.servers is None
