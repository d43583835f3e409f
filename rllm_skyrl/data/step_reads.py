"""Steps' ids, logprobs and advantages read and checked: a batch's a chunk of trajectories at a
time, a step alone to name its first problem.

A few numpy calls per list, or even per trajectory, were most of the conversion at a small model's
shape (hundreds of rows of a few dozen tokens), so consecutive trajectories' steps are read end to
end into two buffers and the rules checked once for all. Only a chunk that breaks a rule has its
trajectories checked one by one; one that breaks a rule or cannot be read is read again step by
step (``step_run``), each list checked as soon as it is read, so the first problem met is named.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from rllm_skyrl.data.trajectory_checks import LOGPROB_TOLERANCE, RowRules, required, trajectory_steps
from rllm_skyrl.data.value_checks import IdLists, MalformedTrajectoryError, RealLists, real_scalar

# About 1 MiB of int64 ids a chunk: small enough that its buffer is still in the core's cache when
# its rows are merged (one buffer for a whole 2 M-token batch made the conversion slower, not faster).
CHUNK_IDS = 1 << 17


class StepRun(NamedTuple):
    """A checked step, as the merge into rows reads it: its prompt then its response ids are one run
    ``[start, stop)`` of an int64 buffer ``ids`` (the prompt ``[start, middle)``); its logprobs and
    its precomputed advantages (``use_precomputed_advantages``; a scalar when one value holds for
    every token)."""

    ids: np.ndarray
    start: int
    middle: int
    stop: int
    logprobs: np.ndarray
    advantages: np.ndarray | float | None


class StepReads:
    """Steps read end to end: step ``k``'s prompt and response ids are ``ids`` lists ``2k`` and
    ``2k + 1``, its logprobs ``logprobs`` list ``k``. ``alone``: each list is checked as soon as it
    is read (``IdLists`` then reads exactly as it names); otherwise ``keep_rules`` checks many."""

    def __init__(self, config: RowRules, alone: bool) -> None:
        self.alone = alone
        self.ids = IdLists(config.vocab_size, fast=not alone)
        remedy = "the rollout engine must return one log p <= 0 per sampled token (logprobs, not logits)"
        self.logprobs = RealLists(LOGPROB_TOLERANCE, remedy)
        self.advantages: list[np.ndarray | float | None] = []
        self.precomputed = config.use_precomputed_advantages

    def read(self, label: str, index: int, step: Any) -> None:
        """Append one step; raises ``MalformedTrajectoryError`` for what reading finds and, ``alone``,
        for any rule a list breaks."""
        for name in ("prompt_ids", "response_ids"):
            self.ids.read(label, index, name, required(label, index, step, name))
            if self.alone:
                self.ids.check_last(label, index, name)
        length = self.ids.bounds[-1] - self.ids.bounds[-2]
        if not length:
            remedy = "drop steps where the model produced no tokens"
            raise MalformedTrajectoryError(label, index, "response_ids", "empty response", remedy)
        self.logprobs.read(label, index, "logprobs", required(label, index, step, "logprobs"), length)
        if self.alone:
            self.logprobs.check_last(label, index, "logprobs")
        self.advantages.append(_step_advantages(label, index, step, length) if self.precomputed else None)

    def read_trajectory(self, trajectory: Any) -> tuple[int, int] | None:
        """Append a trajectory's steps, ``[first, stop)`` of those read; ``None`` (nothing appended)
        when one cannot be read."""
        first = len(self.advantages)
        try:
            for index, step in enumerate(trajectory_steps(trajectory, "")):
                self.read("", index, step)
        except MalformedTrajectoryError:  # named by step_run, after whatever comes before it
            self.ids.truncate(2 * first)
            self.logprobs.truncate(first)
            del self.advantages[first:]
            return None
        return first, len(self.advantages)

    def keep_rules(self, first: int, stop: int) -> bool:
        return self.ids.breach(2 * first, 2 * stop) is None and self.logprobs.breach(first, stop) is None

    @cached_property
    def _buffers(self) -> tuple[np.ndarray, np.ndarray]:
        return self.ids.values(), self.logprobs.values()

    def runs(self, first: int, stop: int) -> list[StepRun]:
        """Steps ``[first, stop)`` as runs of the buffers, which then no longer grow."""
        (ids, logprobs), bounds, logprob_bounds = self._buffers, self.ids.bounds, self.logprobs.bounds
        return [
            StepRun(
                ids,
                *bounds[2 * k : 2 * k + 3],
                logprobs[logprob_bounds[k] : logprob_bounds[k + 1]],
                self.advantages[k],
            )
            for k in range(first, stop)
        ]


def _step_advantages(label: str, index: int, step: Any, n_response: int) -> np.ndarray | float:
    """A step's precomputed advantage: one finite real, or one per response token."""
    value = getattr(step, "advantage", None)
    remedy = "with use_precomputed_advantages every step needs a finite float or one per response token"
    if value is None:
        raise MalformedTrajectoryError(label, index, "advantage", "step.advantage is None", remedy)
    if not isinstance(value, list | tuple | np.ndarray):
        return real_scalar(label, index, "advantage", value, remedy)
    values = RealLists(math.inf, remedy)
    values.read(label, index, "advantage", value, n_response)
    values.check_last(label, index, "advantage")
    return values.values()


def step_run(label: str, index: int, step: Any, config: RowRules) -> StepRun:
    """One step read alone, each list checked as soon as it is read: its first problem is raised."""
    reads = StepReads(config, alone=True)
    reads.read(label, index, step)
    return reads.runs(0, 1)[0]


def batch_step_runs(trajectories: Iterable[Any], config: RowRules) -> Iterator[list[StepRun] | None]:
    """For each of ``trajectories`` in order: its steps as runs of a chunk's buffers when they keep
    every rule, else ``None`` (``step_run`` then names the first problem)."""
    pending = iter(trajectories)
    while True:
        reads, spans = StepReads(config, alone=False), []
        for trajectory in pending:
            spans.append(reads.read_trajectory(trajectory))
            if reads.ids.bounds[-1] >= CHUNK_IDS:
                break
        if not spans:
            return
        clean = reads.keep_rules(0, len(reads.advantages))
        for span in spans:
            yield reads.runs(*span) if span is not None and (clean or reads.keep_rules(*span)) else None
