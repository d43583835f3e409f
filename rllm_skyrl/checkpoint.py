"""Atomic checkpoints and exact resume.

Layout under ``root`` (``training.default_local_dir``)::

    global_step_N/
        policy/              SkyRL's FSDP checkpoint: weights, optimizer moments, LR scheduler, RNG
        critic/              the same, for PPO with a critic (the frozen reference model is not saved)
        trainer_state.json   step, data-loader position, driver RNG
    latest                   "global_step_N" of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory, flushed to disk, and renamed into
place only when every part is there; then ``latest`` is replaced atomically. A process killed at
any point of a save leaves the previous checkpoint and ``latest`` usable; the orphaned temporary
directory is removed by the next save. Re-saving an existing step (after resuming from an older
one) moves the old directory aside first and deletes it only once the new one is in place.

Resume modes (``training.resume_mode``): ``auto`` continues from ``latest`` if there is one,
``disable`` starts from step 1 whatever is on disk, ``resume_path`` loads
``training.resume_from_path`` (a ``global_step_N`` directory, or a root holding ``latest``).

One run per directory: ``CheckpointLock`` holds ``<root>/.lock`` for a run's lifetime; a second run
on the same root fails at once, naming the process that holds it. What a resume will load (the
pointer, ``trainer_state.json``, the role directories) is checked before any worker starts
(``validate``), with errors naming the file. SkyRL's workers unpickle their checkpoint files
(``torch.load(weights_only=False)``), so a checkpoint others may write is refused.
"""

from __future__ import annotations

import ast
import asyncio
import errno
import fcntl
import json
import logging
import os
import random
import re
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rllm_skyrl.errors import UserFacingError
from rllm_skyrl.run_config.resolve import RESUME_MODES

logger = logging.getLogger(__name__)

STEP_PREFIX = "global_step_"
LATEST = "latest"
STATE_FILE = "trainer_state.json"
LOCK_FILE = ".lock"
_TMP = f".tmp_{STEP_PREFIX}"
_OLD = f".old_{STEP_PREFIX}"
_POINTER = re.compile(rf"{STEP_PREFIX}(\d+)")
_SCRATCH = re.compile(rf"\.(?:tmp|old)_{STEP_PREFIX}\d+_(\d+)")
_STATE_KEYS = {"global_step": int, "rng": dict, "roles": list}


class CheckpointError(UserFacingError):
    """A checkpoint that cannot be resumed from; the message names the file and what to do."""


class CheckpointLock:
    """An exclusive lock on a checkpoint root for one run (released when the process ends)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._file = None

    def acquire(self) -> CheckpointLock:
        self.root.mkdir(parents=True, exist_ok=True)
        handle = open(self.root / LOCK_FILE, "a+")  # noqa: SIM115 (held for the run's lifetime)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise CheckpointError(
                f"checkpoint directory {self.root} is in use by another run (PID {holder}); wait for it, "
                "or give this run its own training.default_local_dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _refuse_foreign_writers(path: Path) -> None:
    """SkyRL's resume unpickles these files: refuse ones another user owns or others may write."""
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointError(
            f"{path} is owned by another user or writable by others, and resuming unpickles what it "
            "holds (code execution); fix its owner and mode (chmod go-w) or resume from a copy you own"
        )


# Crash tests' seam: called with (step, temporary directory) once a save has written and flushed
# every part and before it publishes them, so a test can kill the run at exactly that point.
# None in every real run.
before_publish: Callable[[int, Path], None] | None = None


def _rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state()
    return {
        "python": repr(random.getstate()),
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }


def _restore_rng(state: dict[str, Any]) -> None:
    random.setstate(ast.literal_eval(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root``, so a rename never publishes unwritten data."""
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(directory))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _step_of(path: Path) -> int | None:
    suffix = path.name.removeprefix(STEP_PREFIX)
    return int(suffix) if path.name.startswith(STEP_PREFIX) and suffix.isdigit() else None


class CheckpointManager:
    """Saves and restores the workers' state (of ``roles``) plus the driver's position in the data.

    Built before anything starts, so ``validate`` can refuse a bad checkpoint first; ``save`` and
    ``resume`` are handed the workers.
    """

    def __init__(self, root: str | Path, roles: tuple[str, ...], max_to_keep: int = -1):
        if "://" in str(root):
            raise ValueError(
                f"checkpoint directory {root!r}: atomic checkpoints need a local or shared filesystem "
                "(rename is not atomic on object stores); set training.default_local_dir to a path"
            )
        self.root = Path(root)
        self.roles = tuple(role for role in roles if role != "ref")  # the reference never changes
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}{step}"

    def latest_step(self) -> int | None:
        """The step ``latest`` names, or None when nothing was saved yet."""
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        if not _POINTER.fullmatch(name):
            raise CheckpointError(
                f"{pointer} holds {name[:80]!r}, not '{STEP_PREFIX}<N>'; point it at a complete "
                f"{STEP_PREFIX}N directory, or delete it to start over"
            )
        if not (self.root / name / STATE_FILE).exists():
            self._recover_moved_aside(name)
        if not (self.root / name / STATE_FILE).exists():
            raise CheckpointError(
                f"{pointer} names {name!r}, which is not a complete checkpoint; point it at a complete "
                f"{STEP_PREFIX}N directory, or delete it to start over"
            )
        return int(name.removeprefix(STEP_PREFIX))

    def _recover_moved_aside(self, name: str) -> None:
        """A save killed between moving an old ``name`` aside and renaming its replacement in."""
        for old in sorted(self.root.glob(f".old_{name}_*")):
            if (old / STATE_FILE).exists() and not (self.root / name).exists():
                os.rename(old, self.root / name)
                logger.warning("restored %s from an interrupted re-save", self.root / name)
                return

    def save(self, step: int, trainer_state: Any, workers: Any) -> Path:
        """Write ``global_step_<step>`` atomically and point ``latest`` at it."""
        start = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_scratch(f"{_TMP}*")
        final = self.step_dir(step)
        tmp = self.root / f"{_TMP}{step}_{os.getpid()}"
        tmp.mkdir()
        for role in self.roles:
            workers.save_checkpoint(role, str(tmp / role))
            finalize = getattr(getattr(workers, "dispatch", None), "finalize_pending_saves", None)
            if finalize is not None:  # SkyRL's async checkpoint writes (Megatron) must land first
                finalize(role)
        loader = getattr(trainer_state, "train_dataloader", None)
        state = {
            "global_step": step,
            "epoch": getattr(trainer_state, "epoch", 0),
            "dataloader": loader.state_dict() if loader is not None else None,
            "rng": _rng_state(),
            "roles": self.roles,
            "saved_at": time.time(),
        }
        (tmp / STATE_FILE).write_text(json.dumps(state))
        _fsync_tree(tmp)
        if before_publish is not None:
            before_publish(step, tmp)
        old = None
        if final.exists():  # re-saving a step (after resuming from an older one): replace it whole
            old = self.root / f"{_OLD}{step}_{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        _write_atomic(self.root / LATEST, final.name)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._prune(step)
        logger.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - start)
        return final

    def _prune(self, current: int) -> None:
        """Keep the newest ``max_to_keep`` checkpoints up to ``current``; never the one just saved.

        Checkpoints of later steps (left by a run this one resumed from an earlier point of) are
        not counted or touched; they are replaced as this run reaches those steps.
        """
        self._remove_scratch(f"{_OLD}*")
        if self.max_to_keep <= 0:
            return
        steps = sorted(s for p in self.root.iterdir() if (s := _step_of(p)) is not None and s <= current)
        for old_step in steps[: -self.max_to_keep]:
            shutil.rmtree(self.step_dir(old_step), ignore_errors=True)

    def _remove_scratch(self, pattern: str) -> None:
        """This process's leftover temporary directories, and those of processes no longer alive;
        never another live process's (a save in progress)."""
        for path in self.root.glob(pattern):
            match = _SCRATCH.fullmatch(path.name)
            if match and (int(match.group(1)) == os.getpid() or not _pid_alive(int(match.group(1)))):
                shutil.rmtree(path, ignore_errors=True)

    def resolve(self, mode: str, path: str | None) -> Path | None:
        """The checkpoint directory a resume in ``mode`` loads, or None to start from step 1."""
        if mode not in RESUME_MODES:
            raise ValueError(f"training.resume_mode={mode!r}: choose one of {RESUME_MODES}")
        if mode == "disable":
            try:
                latest = self.latest_step()
            except CheckpointError:  # a broken pointer does not matter to a run that ignores it
                latest = None
            if latest is not None:
                logger.warning(
                    "training.resume_mode=disable: starting from step 1 although %s holds checkpoints "
                    "up to step %d; they are overwritten as this run reaches their steps",
                    self.root,
                    latest,
                )
            return None
        if mode == "resume_path":
            if not path:
                raise ValueError("training.resume_mode=resume_path needs training.resume_from_path")
            directory = Path(path)
            if not (directory / STATE_FILE).exists() and (directory / LATEST).exists():
                directory = directory / (directory / LATEST).read_text().strip()
            if not (directory / STATE_FILE).exists():
                raise FileNotFoundError(
                    f"training.resume_from_path={path}: not a checkpoint (no {STATE_FILE}); give a "
                    f"{STEP_PREFIX}N directory or a checkpoint root holding a '{LATEST}' file"
                )
            return directory
        step = self.latest_step()
        return None if step is None else self.step_dir(step)

    def validate(self, mode: str, path: str | None) -> Path | None:
        """What ``resume`` will load, checked without loading it (no worker needed): the pointer, the
        state file's content, the role directories, who may write them. None: start from step 1."""
        directory = self.resolve(mode, path)
        if directory is None:
            return None
        state_file = directory / STATE_FILE
        try:
            state = json.loads(state_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(
                f"{state_file} is unreadable ({type(error).__name__}: {error}); resume from an earlier "
                f"{STEP_PREFIX}N directory (training.resume_mode=resume_path) or start over (disable)"
            ) from None
        problems = [
            f"'{key}' is missing or not a {kind.__name__}"
            for key, kind in _STATE_KEYS.items()
            if not isinstance(state.get(key) if isinstance(state, dict) else None, kind)
        ]
        if not problems and not {"python", "numpy", "torch"} <= set(state["rng"]):
            problems.append("'rng' lacks python/numpy/torch states")
        if problems:
            raise CheckpointError(
                f"{state_file}: {'; '.join(problems)}; it was not written by a complete save"
            )
        missing = [role for role in self.roles if not (directory / role).is_dir()]
        if missing:
            raise CheckpointError(
                f"{directory} has no {'/'.join(missing)} checkpoint (saved roles: {state.get('roles')}); "
                "was it made with a different algorithm (e.g. without a critic)?"
            )
        for checked in [directory, *(directory / role for role in self.roles)]:
            _refuse_foreign_writers(checked)
            for child in checked.iterdir():
                _refuse_foreign_writers(child)
        return directory

    def resume(self, mode: str, path: str | None, trainer_state: Any, workers: Any) -> int | None:
        """Restore workers, step counter, data position and RNG; returns the step resumed from."""
        directory = self.validate(mode, path)
        if directory is None:
            return None
        state = json.loads((directory / STATE_FILE).read_text())
        if mode == "auto":
            saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.get("saved_at", 0)))
            logger.warning(
                "resuming from %s (step %d, saved %s); pass training.resume_mode=disable to start over",
                directory,
                state["global_step"],
                saved,
            )
        start = time.perf_counter()
        for role in self.roles:
            workers.load_checkpoint(role, str(directory / role))
        trainer_state.global_step = state["global_step"]
        trainer_state.epoch = state.get("epoch", 0)
        loader = getattr(trainer_state, "train_dataloader", None)
        if loader is not None and state.get("dataloader") is not None:
            loader.load_state_dict(state["dataloader"])
        _restore_rng(state["rng"])
        seconds = time.perf_counter() - start
        logger.info("resumed from %s (step %d) in %.2f s", directory, state["global_step"], seconds)
        return state["global_step"]


def claim_checkpoints(
    settings: Any, roles: tuple[str, ...]
) -> tuple[CheckpointManager, CheckpointLock, Path | None]:
    """This run's checkpoints (``run.checkpoint`` settings): the manager, the directory's lock (held
    until released), and the checkpoint a resume will load (None: step 1), checked without loading."""
    manager = CheckpointManager(settings.root, roles, settings.max_to_keep)
    lock = CheckpointLock(settings.root).acquire()
    try:
        return manager, lock, manager.validate(settings.resume_mode, settings.resume_from_path)
    except BaseException:
        lock.release()
        raise


def failure_report(error: BaseException | None, step: int, checkpoints: CheckpointManager | None) -> str:
    """One line for a run that stopped: what failed, and which checkpoint a rerun continues from."""
    import ray.exceptions

    first_line = (str(error).strip().splitlines() or [""])[0]
    cause = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
    if isinstance(error, (asyncio.CancelledError, KeyboardInterrupt)):
        cause = "stopped by Ctrl-C or SIGTERM"  # inside asyncio.run both cancel the main task
    elif isinstance(error, ray.exceptions.RayActorError):
        cause = f"a SkyRL training worker died ({cause})"
    elif "No space left on device" in str(error) or getattr(error, "errno", None) == errno.ENOSPC:
        where = checkpoints.root if checkpoints is not None else "the checkpoint directory"
        cause = f"the disk holding {where} is full ({cause}); free space first"
    try:
        latest = checkpoints.latest_step() if checkpoints is not None else None
    except CheckpointError:
        latest = None
    if latest is None:
        where = "no checkpoint was saved, so a rerun starts from step 1"
    else:
        where = (
            f"rerun with training.resume_mode=auto to continue after step {latest} "
            f"({checkpoints.step_dir(latest)})"
        )
    return f"training stopped at step {step}: {cause}; {where}"
