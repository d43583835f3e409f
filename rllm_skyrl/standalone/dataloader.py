"""A stateful, seeded, shuffling dataloader over task rows, for exact mid-epoch resume.

The order of epoch ``e`` is a pure function of ``(seed, e)``, and the state is the position of
the next batch: ``{epoch, cursor, seed}``. The state advances when a batch is handed out (to the
next epoch when it is the epoch's last), so a checkpoint taken while a batch trains resumes at
the following batch: none repeated, none skipped.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

Rows = Sequence[dict[str, Any]]


def load_rows(dataset: Rows | pd.DataFrame | str | Path) -> Rows:
    """Task rows from a list of dicts, a DataFrame, or a parquet file.

    Tables go through Arrow's ``to_pylist`` so nested columns come back as plain lists and
    dicts (pandas would hand workflows numpy arrays for e.g. a ``messages`` column).
    """
    if isinstance(dataset, str | Path):
        return pq.read_table(dataset).to_pylist()
    if isinstance(dataset, list | tuple):  # before naming pandas, which runs it (``lazy_imports``)
        return dataset
    if isinstance(dataset, pd.DataFrame):
        return pa.Table.from_pandas(dataset, preserve_index=False).to_pylist()
    return dataset


class StatefulTaskDataLoader:
    """Yields ``list[dict]`` batches of one epoch per ``for`` loop, starting at the saved position."""

    def __init__(
        self,
        dataset: Rows | pd.DataFrame | str | Path,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.rows = load_rows(dataset)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._seed = seed
        self._epoch = 0
        self._cursor = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.rows)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def _order(self, epoch: int) -> list[int]:
        indices = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self._seed + epoch).shuffle(indices)
        return indices

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        order = self._order(self._epoch)
        batches_left = len(self) - math.ceil(self._cursor / self.batch_size)
        if batches_left <= 0:  # resumed at the very end of an epoch, or fewer rows than a batch
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
        self._epoch = int(state["epoch"])
        self._cursor = int(state["cursor"])
        self._seed = int(state.get("seed", self._seed))
