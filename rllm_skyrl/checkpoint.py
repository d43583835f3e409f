"""Atomic checkpoints and exact resume.

Layout under ``root`` (``training.default_local_dir``)::

    global_step_N/
        policy/              SkyRL's FSDP checkpoint: weights, optimizer moments, LR scheduler, RNG
        critic/              the same, for PPO with a critic (the frozen reference model is not saved)
        trainer_state.json   step, data-loader position, driver RNG
    latest                   "global_step_N" of the newest complete checkpoint

A checkpoint is published atomically, and one run at a time holds a root (``checkpoint_dirs``):
a process killed at any point of a save leaves the previous checkpoint and ``latest`` usable.

Resume modes (``training.resume_mode``): ``auto`` continues from ``latest`` if there is one,
``disable`` starts from step 1 whatever is on disk, ``resume_path`` loads
``training.resume_from_path`` (a ``global_step_N`` directory, or a root holding ``latest``).

What a resume will load (the pointer, ``trainer_state.json``, the role directories) is checked
before any worker starts (``validate``), with errors naming the file; SkyRL's workers unpickle
their checkpoint files, so a checkpoint others may write is refused.
"""

from __future__ import annotations

import ast
import asyncio
import errno
import json
import logging
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rllm_skyrl.checkpoint_dirs import (
    LATEST,
    OLD_PREFIX,
    STEP_PREFIX,
    CheckpointError,
    CheckpointLock,
    new_scratch_dir,
    publish,
    recover_moved_aside,
    refuse_foreign_writers,
    remove_scratch,
    step_dir,
    step_of,
)
from rllm_skyrl.run_config.resolve import RESUME_MODES

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
_POINTER = re.compile(rf"{STEP_PREFIX}(\d+)")
_STATE_KEYS = {"global_step": int, "rng": dict, "roles": list}


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
        return step_dir(self.root, step)

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
            recover_moved_aside(self.root, name, STATE_FILE)
        if not (self.root / name / STATE_FILE).exists():
            raise CheckpointError(
                f"{pointer} names {name!r}, which is not a complete checkpoint; point it at a complete "
                f"{STEP_PREFIX}N directory, or delete it to start over"
            )
        return int(name.removeprefix(STEP_PREFIX))

    def save(self, step: int, trainer_state: Any, workers: Any) -> Path:
        """Write ``global_step_<step>`` atomically and point ``latest`` at it."""
        start = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = new_scratch_dir(self.root, step)
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
        (tmp / STATE_FILE).write_text(json.dumps(state))  # written last: it marks the step complete
        final = publish(self.root, step, tmp)
        self._prune(step)
        logger.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - start)
        return final

    def _prune(self, current: int) -> None:
        """Keep the newest ``max_to_keep`` checkpoints up to ``current``; never the one just saved.

        Checkpoints of later steps (left by a run this one resumed from an earlier point of) are
        not counted or touched; they are replaced as this run reaches those steps.
        """
        remove_scratch(self.root, f"{OLD_PREFIX}*")
        if self.max_to_keep <= 0:
            return
        steps = sorted(s for p in self.root.iterdir() if (s := step_of(p)) is not None and s <= current)
        for old_step in steps[: -self.max_to_keep]:
            shutil.rmtree(self.step_dir(old_step), ignore_errors=True)

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
            refuse_foreign_writers(checked)
            for child in checked.iterdir():
                refuse_foreign_writers(child)
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
