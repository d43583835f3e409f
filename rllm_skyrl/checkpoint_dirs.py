"""Checkpoint directories on disk: one run per root, and steps published atomically.

A step is written into a hidden temporary directory, flushed to disk, and renamed into place only
when every part is there; then ``latest`` is replaced atomically (``publish``). A process killed
at any point of a save leaves the previous checkpoint and ``latest`` usable; the orphaned
temporary directory is removed by the next save. Re-publishing an existing step (after resuming
from an older one) moves the old directory aside first and deletes it only once the new one is in
place; a save killed in between is undone by ``recover_moved_aside``.

One run per directory: ``CheckpointLock`` holds ``<root>/.lock`` for a run's lifetime; a second run
on the same root fails at once, naming the process that holds it. SkyRL's workers unpickle their
checkpoint files (``torch.load(weights_only=False)``), so ``refuse_foreign_writers`` refuses a
checkpoint others may write.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from rllm_skyrl.errors import UserFacingError

logger = logging.getLogger(__name__)

STEP_PREFIX = "global_step_"
LATEST = "latest"
LOCK_FILE = ".lock"
TMP_PREFIX = f".tmp_{STEP_PREFIX}"
OLD_PREFIX = f".old_{STEP_PREFIX}"
_SCRATCH = re.compile(rf"\.(?:tmp|old)_{STEP_PREFIX}\d+_(\d+)")

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


def refuse_foreign_writers(path: Path) -> None:
    """SkyRL's resume unpickles these files: refuse ones another user owns or others may write."""
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CheckpointError(
            f"{path} is owned by another user or writable by others, and resuming unpickles what it "
            "holds (code execution); fix its owner and mode (chmod go-w) or resume from a copy you own"
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
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
    _fsync_dir(root)
    _write_atomic(root / LATEST, final.name)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def recover_moved_aside(root: Path, name: str, marker: str) -> None:
    """Undo a save killed between moving an old ``name`` aside and renaming its replacement in;
    ``marker`` is the file a complete step directory holds."""
    for old in sorted(root.glob(f".old_{name}_*")):
        if (old / marker).exists() and not (root / name).exists():
            os.rename(old, root / name)
            logger.warning("restored %s from an interrupted re-save", root / name)
            return


def remove_scratch(root: Path, pattern: str) -> None:
    """This process's leftover temporary directories, and those of processes no longer alive;
    never another live process's (a save in progress)."""
    for path in root.glob(pattern):
        match = _SCRATCH.fullmatch(path.name)
        if match and (int(match.group(1)) == os.getpid() or not _pid_alive(int(match.group(1)))):
            shutil.rmtree(path, ignore_errors=True)
