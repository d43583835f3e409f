"""A trajectory's steps, checked, merged into training rows: multi-turn merging.

A step whose prompt starts with everything the row holds so far continues that row: its extra
prompt tokens are observations (``loss_mask``, logprob and advantage 0), its response tokens are
trained. Any other step starts a new row. Steps are first split by ``metadata["lineage_id"]`` (a
sub-agent's turns never extend its parent's), as rLLM's transforms do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rllm_skyrl.data.batch_layout import RowSpec, Span
from rllm_skyrl.data.step_reads import StepRun, step_run
from rllm_skyrl.data.trajectory_checks import (
    RowRules,
    check_group_id,
    check_role,
    outcome_reward,
    reward_given,
    step_lineage,
    trajectory_label,
    trajectory_steps,
)
from rllm_skyrl.data.value_checks import MalformedTrajectoryError, real_scalar


@dataclass
class Row:
    """One training row under construction: a prompt and its response window.

    The row so far is always ``last``'s prompt and response, which a continuing step's prompt must
    start with. ``advantage``: the trajectory's, for every trained token (else each step's own).
    """

    label: str
    group_id: str
    first_step: int
    last: StepRun
    prompt_length: int
    advantage: float | None
    trained: list[Span] = field(default_factory=list)
    reward: float = 0.0
    model_tokens: int = 0
    last_step: int = 0

    @property
    def length(self) -> int:
        return self.last.stop - self.last.start

    @property
    def response_length(self) -> int:
        return self.length - self.prompt_length

    def extended_by(self, run: StepRun) -> bool:
        """Whether the step's prompt starts with the row so far. Compared as bytes: copying both runs
        and one ``memcmp`` take 0.6 ns an id, two memoryviews compare element by element (1.7 ns; a
        4-turn batch at a GPU run's shape compares 3.8 M ids)."""
        last, length = self.last, self.length
        return (
            run.middle - run.start >= length
            and run.ids[run.start : run.start + length].tobytes()
            == last.ids[last.start : last.start + length].tobytes()
        )

    def append(self, index: int, run: StepRun) -> None:
        column = run.middle - run.start - self.prompt_length
        advantages = run.advantages if self.advantage is None else self.advantage
        self.trained.append(Span(column, run.stop - run.middle, run.logprobs, advantages))
        self.model_tokens += run.stop - run.middle
        self.last, self.last_step = run, index

    @property
    def step_span(self) -> str:
        if self.first_step == self.last_step:
            return f"step {self.first_step}"
        return f"steps {self.first_step}-{self.last_step}"

    @property
    def row_id(self) -> str:
        return f"{self.label} {self.step_span}"

    def spec(self) -> RowSpec:
        last = self.last
        return RowSpec(last.ids[last.start : last.stop], self.prompt_length, self.trained, self.reward)


def _lineages(label: str, steps: Sequence[Any]) -> list[list[tuple[int, Any]]]:
    """Steps split by ``metadata["lineage_id"]`` in first-seen order; untagged steps share one lineage."""
    by_lineage: dict[Any, list[tuple[int, Any]]] = {}
    for index, step in enumerate(steps):
        by_lineage.setdefault(step_lineage(label, index, step), []).append((index, step))
    return list(by_lineage.values())


NO_ADVANTAGE = object()


def trajectory_rows(
    group: Any,
    t: int,
    trajectory: Any,
    config: RowRules,
    advantage: Any,
    runs: list[StepRun] | None,
) -> tuple[list[Row], int]:
    """Validate one trajectory and merge its steps into rows; raises ``MalformedTrajectoryError``.
    ``advantage``: the trajectory's scalar or ``NO_ADVANTAGE``; ``runs``: its steps, if the batch's
    reads (``batch_step_runs``) checked them."""
    label = trajectory_label(group, t)
    group_id = check_group_id(group, label)
    check_role(trajectory, label, config)
    steps = trajectory_steps(trajectory, label)
    # A bad reward is the usual cause of a bad advantage, so it is named first; a missing one waits
    # for the steps, whose own problems (a step that is not a step) are then the cause.
    reward = outcome_reward(trajectory, label, config) if reward_given(trajectory) else None
    remedy = "check the advantage estimator's inputs"
    scalar = None if advantage is NO_ADVANTAGE else real_scalar(label, None, "advantage", advantage, remedy)
    rows: list[Row] = []
    for lineage in _lineages(label, steps):
        row: Row | None = None
        for index, step in lineage:
            # read again step by step when the batch's reads found a problem: the first met is named
            run = runs[index] if runs is not None else step_run(label, index, step, config)
            if row is not None and row.extended_by(run):
                row.append(index, run)
            elif run.middle == run.start:
                raise MalformedTrajectoryError(
                    label, index, "prompt_ids", "empty prompt", "a row needs at least one prompt token"
                )
            else:
                row = Row(label, group_id, index, run, run.middle - run.start, scalar)
                row.append(index, run)
                rows.append(row)
            if config.max_seq_len is not None and row.length > config.max_seq_len:
                problem = (
                    f"the row built from {row.step_span} has {row.length} tokens, "
                    f"more than max_seq_len={config.max_seq_len}"
                )
                remedy = "raise max_seq_len or cap the rollout's prompt and response lengths"
                raise MalformedTrajectoryError(label, index, "sequence", problem, remedy)
    if reward is None:
        reward = outcome_reward(trajectory, label, config)
    for row in rows:
        row.reward = reward
    return rows, len(steps)
