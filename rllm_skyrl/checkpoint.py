"""Atomic checkpoints and exact resume.

Layout under ``root``::

    global_step_N/
        policy/              SkyRL's FSDP checkpoint: weights, optimizer moments, LR scheduler, RNG
        critic/              the same, for PPO with a critic
        trainer_state.json   step, data-loader position, driver RNG
    latest                   "global_step_N" of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory and renamed into place only when every
part is on disk, then ``latest`` is replaced atomically. A process killed mid-save leaves the
previous checkpoint and pointer untouched; the orphaned temporary directory is removed by the next
save.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

STEP_PREFIX = "global_step_"
LATEST = "latest"
STATE_FILE = "trainer_state.json"


def _rng_state() -> dict[str, Any]:
    numpy_state = np.random.get_state()
    return {
        "python": repr(random.getstate()),
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }


def _restore_rng(state: dict[str, Any]) -> None:
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class CheckpointManager:
    """Saves and restores the workers' state plus the driver's position in the data."""

    def __init__(self, root: str | Path, workers: Any, max_to_keep: int = -1):
        self.root = Path(root)
        self.workers = workers
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}{step}"

    def latest_step(self) -> int | None:
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        if not (self.root / name / STATE_FILE).exists():
            raise RuntimeError(
                f"{pointer} names {name!r}, which is not a complete checkpoint; fix or delete the pointer"
            )
        return int(name.removeprefix(STEP_PREFIX))

    def save(self, step: int, trainer_state: Any) -> Path:
        """Write ``global_step_<step>`` atomically and point ``latest`` at it."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f".tmp_{STEP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        final = self.step_dir(step)
        tmp = self.root / f".tmp_{final.name}_{os.getpid()}"
        for role in self.workers.roles:
            if role != "ref":  # the reference model never changes
                self.workers.save_checkpoint(role, str(tmp / role))
        loader = getattr(trainer_state, "train_dataloader", None)
        state = {
            "global_step": step,
            "epoch": getattr(trainer_state, "epoch", 0),
            "dataloader": loader.state_dict() if loader is not None else None,
            "rng": _rng_state(),
        }
        (tmp / STATE_FILE).write_text(json.dumps(state))
        if final.exists():  # re-saving a step (e.g. after resume): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_atomic(self.root / LATEST, final.name)
        self._prune()
        logger.info("saved checkpoint %s", final)
        return final

    def _prune(self) -> None:
        if self.max_to_keep <= 0:
            return
        steps = sorted(int(p.name.removeprefix(STEP_PREFIX)) for p in self.root.glob(f"{STEP_PREFIX}*"))
        for old in steps[: -self.max_to_keep]:
            shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def resume(self, mode: str, path: str | None, trainer_state: Any) -> int | None:
        """Restore workers, step counter, data position and RNG; returns the step resumed from."""
        if mode == "disable":
            return None
        if mode == "resume_path":
            directory = Path(path)
        else:
            step = self.latest_step()
            if step is None:
                return None
            directory = self.step_dir(step)
        state_file = directory / STATE_FILE
        if not state_file.exists():
            raise FileNotFoundError(
                f"{directory} is not a checkpoint (no {STATE_FILE}); check training.resume_from_path"
            )
        state = json.loads(state_file.read_text())
        for role in self.workers.roles:
            if role != "ref":
                self.workers.load_checkpoint(role, str(directory / role))
        trainer_state.global_step = state["global_step"]
        trainer_state.epoch = state.get("epoch", 0)
        loader = getattr(trainer_state, "train_dataloader", None)
        if loader is not None and state.get("dataloader") is not None:
            loader.load_state_dict(state["dataloader"])
        _restore_rng(state["rng"])
        logger.info("resumed from %s (step %d)", directory, state["global_step"])
        return state["global_step"]
