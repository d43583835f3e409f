"""A stateful, seeded, shuffling loader over task rows, for exact mid-epoch resume (rLLM's contract).

The order of epoch ``e`` is a pure function of ``(seed, e)``, and the state is the position of the
next batch: ``{epoch, cursor, seed}`` (``state_dict`` / ``load_state_dict``, which the backend's
checkpoints save and restore). The state advances when a batch is handed out, to the next epoch
when it is the epoch's last, so a checkpoint taken while a batch trains resumes at the following
batch: none repeated, none skipped.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from typing import Any


class StatefulTaskDataLoader:
    """Yields the batches of one epoch per ``for`` loop, starting at the saved position."""

    def __init__(
        self,
        rows: Sequence[Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.rows = rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._seed, self._epoch, self._cursor = seed, 0, 0

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.rows)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def __iter__(self) -> Iterator[list[Any]]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self._seed + self._epoch).shuffle(order)
        batches_left = len(self) - math.ceil(self._cursor / self.batch_size)
        if batches_left <= 0:  # resumed at the very end of an epoch
            self._epoch, self._cursor = self._epoch + 1, 0
            return
        while batches_left > 0:
            start = self._cursor
            batch = [self.rows[i] for i in order[start : start + self.batch_size]]
            batches_left -= 1
            if batches_left == 0:
                self._epoch, self._cursor = self._epoch + 1, 0
            else:
                self._cursor = start + self.batch_size
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "cursor": self._cursor, "seed": self._seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not 0 <= state["cursor"] <= len(self.rows):
            raise ValueError(
                f"dataloader state cursor {state['cursor']} is outside a dataset of {len(self.rows)} rows; "
                "was the checkpoint made with a different dataset?"
            )
        self._epoch, self._cursor = int(state["epoch"]), int(state["cursor"])
        self._seed = int(state.get("seed", self._seed))
