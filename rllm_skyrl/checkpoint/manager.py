"""Atomic checkpoints and exact resume.

Layout under ``root`` (``training.default_local_dir``)::

    global_step_N/
        policy/              SkyRL's FSDP checkpoint: weights, optimizer moments, LR scheduler, RNG
        critic/              the same, for PPO with a critic (the frozen reference model is not saved)
        trainer_state.json   step, data-loader position, driver RNG
    latest                   "global_step_N" of the newest complete checkpoint

How steps are published atomically, locked and read back checked is ``checkpoint.dirs``.

Resume modes (``training.resume_mode``): ``auto`` continues from ``latest`` if there is one,
``disable`` starts from step 1 whatever is on disk, ``resume_path`` loads
``training.resume_from_path`` (a ``global_step_N`` directory, or a root holding ``latest``).
"""

from __future__ import annotations

import ast
import asyncio
import errno
import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rllm_skyrl.checkpoint.dirs import (
    OLD_PREFIX,
    STATE_FILE,
    CheckpointError,
    CheckpointLock,
    claim,
    latest_step,
    new_scratch_dir,
    publish,
    remove_scratch,
    step_dir,
    step_of,
    validate,
)

logger = logging.getLogger(__name__)


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

    Built before anything starts, so a bad checkpoint is refused first (``claim_checkpoints``);
    ``save`` and ``resume`` are handed the workers.
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

    def latest_step(self) -> int | None:
        return latest_step(self.root)

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
            shutil.rmtree(step_dir(self.root, old_step), ignore_errors=True)

    def resume(self, mode: str, path: str | None, trainer_state: Any, workers: Any) -> int | None:
        """Restore workers, step counter, data position and RNG; returns the step resumed from."""
        directory = validate(self.root, self.roles, mode, path)
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


def claim_checkpoints(settings: Any, roles: tuple[str, ...]) -> tuple[CheckpointManager, CheckpointLock]:
    """This run's checkpoints (``run.checkpoint`` settings): the manager and the directory's lock
    (held until released), once what a resume will load is checked without loading it."""
    manager = CheckpointManager(settings.root, roles, settings.max_to_keep)
    lock = claim(manager.root, manager.roles, settings.resume_mode, settings.resume_from_path)
    return manager, lock


MEMORY_ADVICE = (
    "lower skyrl.trainer.micro_train_batch_size_per_gpu and micro_forward_batch_size_per_gpu, or "
    "rllm.data.train_batch_size; on GPUs also ++skyrl.generator.inference_engine.gpu_memory_utilization"
)


def _out_of_memory(error: BaseException | None) -> bool:
    """torch's (CUDA's) and Python's own, and Ray's memory monitor killing a worker: its message, on
    whichever error carries it up (an actor's death, a task's), says "out of memory"."""
    import ray.exceptions

    if isinstance(error, (MemoryError, torch.OutOfMemoryError, ray.exceptions.OutOfMemoryError)):
        return True
    return error is not None and "out of memory" in str(error).lower()


def failure_report(error: BaseException | None, step: int, checkpoints: CheckpointManager | None) -> str:
    """One line for a run that stopped: what failed, and which checkpoint a rerun continues from."""
    import ray.exceptions

    first_line = (str(error).strip().splitlines() or [""])[0]
    cause = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
    if isinstance(error, (asyncio.CancelledError, KeyboardInterrupt)):
        cause = "stopped by Ctrl-C or SIGTERM"  # inside asyncio.run both cancel the main task
    elif _out_of_memory(error):
        cause = f"out of memory ({cause}); {MEMORY_ADVICE}"
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
            f"({step_dir(checkpoints.root, latest)})"
        )
    return f"training stopped at step {step}: {cause}; {where}"
