"""Checkpoint directories on disk: one run per root, steps published atomically, read back checked.

A step is written into a hidden temporary directory, flushed to disk, and renamed into place only
when every part is there; then ``latest`` is replaced atomically (``publish``). A process killed
at any point of a save leaves the previous checkpoint and ``latest`` usable; the orphaned
temporary directory is removed by the next save. Re-publishing an existing step (after resuming
from an older one) moves the old directory aside first and deletes it only once the new one is in
place; a save killed in between is undone when the next run claims the root.

One run per directory: ``claim`` takes ``<root>/.lock`` for a run's lifetime (a second run on the
same root fails at once, naming the process that holds it), repairs an interrupted re-save, and
checks what a resume will load (the pointer, ``trainer_state.json``, the role directories) before
any worker starts, with errors naming the file. SkyRL's workers unpickle their checkpoint files
(``torch.load(weights_only=False)``), so a checkpoint others may write is refused.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from rllm_skyrl.errors import UserFacingError
from rllm_skyrl.run_config.values import RESUME_MODES

logger = logging.getLogger(__name__)

STEP_PREFIX = "global_step_"
LATEST = "latest"
STATE_FILE = "trainer_state.json"  # written last into a step directory: it marks the step complete
LOCK_FILE = ".lock"
TMP_PREFIX = f".tmp_{STEP_PREFIX}"
OLD_PREFIX = f".old_{STEP_PREFIX}"
_SCRATCH = re.compile(rf"\.(?:tmp|old)_{STEP_PREFIX}\d+_(\d+)")
_MOVED_ASIDE = re.compile(rf"\.old_({STEP_PREFIX}\d+)_\d+")
_POINTER = re.compile(rf"{STEP_PREFIX}(\d+)")
_STATE_KEYS = {"global_step": int, "rng": dict, "roles": list}

# Crash tests' seam: called with (step, temporary directory) once a save has written and flushed
# every part and before it publishes them, so a test can kill the run at exactly that point.
# None in every real run.
before_publish: Callable[[int, Path], None] | None = None


class CheckpointError(UserFacingError):
    """A checkpoint that cannot be resumed from; the message names the file and what to do."""


class CheckpointLock:
    """An exclusive lock on a checkpoint root for one run (released when the process ends)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._file = None

    def acquire(self) -> CheckpointLock:
        """Hold the root, then undo any re-save that was killed between its two renames."""
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
        _recover_moved_aside(self.root)
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


def _refuse_foreign_writer(path: Path) -> None:
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointError(
            f"{path} is owned by another user or writable by others, and resuming unpickles what it "
            "holds (code execution); fix its owner and mode (chmod go-w) or resume from a copy you own"
        )


def _fsync(path: str | Path) -> None:
    """Flush a file, or a directory's entries."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root``, so a rename never publishes unwritten data."""
    for directory, _, files in os.walk(root):
        for name in files:
            _fsync(os.path.join(directory, name))
        _fsync(directory)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def step_of(path: Path) -> int | None:
    suffix = path.name.removeprefix(STEP_PREFIX)
    return int(suffix) if path.name.startswith(STEP_PREFIX) and suffix.isdigit() else None


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step}"


def new_scratch_dir(root: Path, step: int) -> Path:
    """A fresh temporary directory to write ``step`` into, after removing orphaned ones."""
    remove_scratch(root, f"{TMP_PREFIX}*")
    tmp = root / f"{TMP_PREFIX}{step}_{os.getpid()}"
    tmp.mkdir()
    return tmp


def publish(root: Path, step: int, tmp: Path) -> Path:
    """Flush ``tmp``, rename it to ``global_step_<step>`` and point ``latest`` at it."""
    fsync_tree(tmp)
    if before_publish is not None:
        before_publish(step, tmp)
    final = step_dir(root, step)
    old = None
    if final.exists():  # re-saving a step (after resuming from an older one): replace it whole
        old = root / f"{OLD_PREFIX}{step}_{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(root)
    _write_atomic(root / LATEST, final.name)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _recover_moved_aside(root: Path) -> None:
    """Put back a step directory a killed re-save had moved aside before renaming its replacement in."""
    for old in sorted(root.glob(f"{OLD_PREFIX}*")):
        match = _MOVED_ASIDE.fullmatch(old.name)
        if match and (old / STATE_FILE).exists() and not (root / match.group(1)).exists():
            os.rename(old, root / match.group(1))
            logger.warning("restored %s from an interrupted re-save", root / match.group(1))


def remove_scratch(root: Path, pattern: str) -> None:
    """This process's leftover temporary directories, and those of processes no longer alive;
    never another live process's (a save in progress)."""
    for path in root.glob(pattern):
        match = _SCRATCH.fullmatch(path.name)
        if match and (int(match.group(1)) == os.getpid() or not _pid_alive(int(match.group(1)))):
            shutil.rmtree(path, ignore_errors=True)


def latest_step(root: Path) -> int | None:
    """The step ``latest`` names, or None when nothing was saved yet."""
    pointer = root / LATEST
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    remedy = f"point it at a complete {STEP_PREFIX}N directory, or delete it to start over"
    if not _POINTER.fullmatch(name):
        raise CheckpointError(f"{pointer} holds {name[:80]!r}, not '{STEP_PREFIX}<N>'; {remedy}")
    if not (root / name / STATE_FILE).exists():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint; {remedy}")
    return int(name.removeprefix(STEP_PREFIX))


def resume_dir(root: Path, mode: str, path: str | None) -> Path | None:
    """The checkpoint directory a resume in ``mode`` loads, or None to start from step 1."""
    if mode not in RESUME_MODES:
        raise ValueError(f"training.resume_mode={mode!r}: choose one of {RESUME_MODES}")
    if mode == "disable":
        try:
            latest = latest_step(root)
        except CheckpointError:  # a broken pointer does not matter to a run that ignores it
            latest = None
        if latest is not None:
            logger.warning(
                "training.resume_mode=disable: starting from step 1 although %s holds checkpoints "
                "up to step %d; they are overwritten as this run reaches their steps",
                root,
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
    step = latest_step(root)
    return None if step is None else step_dir(root, step)


def validate(root: Path, roles: tuple[str, ...], mode: str, path: str | None) -> Path | None:
    """What a resume will load, checked without loading it (no worker needed): the pointer, the
    state file's content, the role directories, who may write them. None: start from step 1."""
    directory = resume_dir(root, mode, path)
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
        raise CheckpointError(f"{state_file}: {'; '.join(problems)}; it was not written by a complete save")
    missing = [role for role in roles if not (directory / role).is_dir()]
    if missing:
        raise CheckpointError(
            f"{directory} has no {'/'.join(missing)} checkpoint (saved roles: {state.get('roles')}); "
            "was it made with a different algorithm (e.g. without a critic)?"
        )
    for checked in [directory, *(directory / role for role in roles)]:
        _refuse_foreign_writer(checked)
        for child in checked.iterdir():
            _refuse_foreign_writer(child)
    return directory


def claim(root: Path, roles: tuple[str, ...], mode: str, path: str | None) -> CheckpointLock:
    """Hold ``root`` for this run (until the lock is released) and check what a resume will load."""
    lock = CheckpointLock(root).acquire()
    try:
        validate(root, roles, mode, path)
        return lock
    except BaseException:
        lock.release()
        raise
