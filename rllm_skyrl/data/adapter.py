"""Trajectory groups (and SFT pairs) -> SkyRL ``TrainingInputBatch``: where episodes become tensors.

Pure data processing: no Ray, no network, no files. Every field is checked (``trajectory_checks``)
and read once, a chunk of trajectories at a time (``step_reads``), and steps are merged into rows
(``trajectory_rows``) before any tensor is built.

``action_log_probs`` (the loss's "old" policy) start as the sampler's logprobs, which is Tinker's
convention; a backend that wants a proximal policy overwrites them with
``dispatch.forward("policy", batch)``. ``values``/``returns`` (critic) and
``base_action_log_probs`` (KL to a reference) are added later by whoever computes them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

from rllm_skyrl.data.batch_layout import RowSpec, Span, build_rows, pad_to_multiple
from rllm_skyrl.data.step_reads import batch_step_runs
from rllm_skyrl.data.trajectory_checks import check_group, group_label
from rllm_skyrl.data.trajectory_rows import NO_ADVANTAGE, Row, trajectory_rows
from rllm_skyrl.data.value_checks import IdLists, MalformedTrajectoryError


class EmptyBatchError(ValueError):
    """Nothing trainable is left (every trajectory was dropped); the caller should skip the update."""


@dataclass(frozen=True)
class BatchConfig:
    """How trajectories become rows. Built once from the run config.

    ``dp_size``: pad rows (``loss_mask`` 0) add nothing to policy losses, which are masked sums;
    losses that average over rows (SkyRL's critic loss, the KL term) count them as zero rows, which
    scales those terms by real/padded rows (at most ``dp_size - 1`` extra rows).
    ``use_precomputed_advantages``: read ``step.advantage`` (a float or one value per response
    token), as rLLM's ``use_precomputed_advantage`` does.
    """

    pad_token_id: int
    dp_size: int = 1
    max_seq_len: int | None = None
    allowed_roles: Collection[str] | None = None
    vocab_size: int | None = None
    drop_malformed: bool = False
    use_precomputed_advantages: bool = False


@dataclass(frozen=True)
class BatchStats:
    """What the conversion did, per kept trajectory and per row; ``metrics()`` uses rLLM's names."""

    num_pad_rows: int = 0
    dropped_malformed: int = 0
    drop_reasons: tuple[str, ...] = ()
    steps_per_traj: tuple[int, ...] = ()
    rows_per_traj: tuple[int, ...] = ()
    response_lengths: tuple[int, ...] = ()
    action_token_ratios: tuple[float, ...] = ()
    drop_fields: tuple[str, ...] = ()

    @property
    def num_rows(self) -> int:
        return len(self.response_lengths)

    @property
    def merge_compression_ratio(self) -> float:
        """Steps per emitted row: N for fully merged N-turn trajectories, 1 when nothing merged."""
        return sum(self.steps_per_traj) / self.num_rows if self.num_rows else 0.0

    def metrics(self) -> dict[str, float]:
        out = {
            "batch/dropped_malformed_sequences": float(self.dropped_malformed),
            "batch/num_rows": float(self.num_rows),
            "batch/num_pad_rows": float(self.num_pad_rows),
            "batch/merge_compression_ratio": self.merge_compression_ratio,
        }
        for field_name, count in sorted(Counter(self.drop_fields).items()):
            out[f"batch/dropped_malformed/{field_name}"] = float(count)
        for name, values in (
            ("steps_per_traj", self.steps_per_traj),
            ("merged_steps_per_traj", self.rows_per_traj),
            ("step_response_length", self.response_lengths),
            ("action_token_ratio", self.action_token_ratios),
        ):
            if values:
                out |= {
                    f"batch/{name}/mean": fmean(values),
                    f"batch/{name}/min": float(min(values)),
                    f"batch/{name}/max": float(max(values)),
                }
        return out


def trajectory_groups_to_batch(
    groups: Sequence[Any],
    config: BatchConfig,
    trajectory_advantages: Sequence[Sequence[float]] | None = None,
) -> tuple[TrainingInputBatch, BatchStats]:
    """Trajectory groups -> one padded ``TrainingInputBatch`` plus conversion stats.

    ``trajectory_advantages[g][t]`` is the scalar advantage of trajectory ``t`` of group ``g``,
    broadcast to its model tokens; ``None`` builds a batch without advantages (GAE adds them after
    the critic's forward) or reads them from the steps (``config.use_precomputed_advantages``).
    A malformed trajectory raises ``MalformedTrajectoryError``, or with ``config.drop_malformed``
    is dropped and counted (a group whose ``trajectories`` is unusable counts as one drop).
    """
    if config.dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {config.dp_size}")
    if trajectory_advantages is not None and config.use_precomputed_advantages:
        raise ValueError("pass trajectory_advantages or set use_precomputed_advantages, not both")
    if trajectory_advantages is not None and len(trajectory_advantages) != len(groups):
        raise ValueError(
            f"trajectory_advantages has {len(trajectory_advantages)} entries for {len(groups)} groups"
        )
    needs_advantages = trajectory_advantages is not None or config.use_precomputed_advantages
    rows: list[Row] = []
    steps_per_traj: list[int] = []
    rows_per_traj: list[int] = []
    dropped: list[MalformedTrajectoryError] = []

    def drop(err: MalformedTrajectoryError) -> None:
        if not config.drop_malformed:
            raise err
        dropped.append(err)

    checked: list[list[Any] | MalformedTrajectoryError] = []  # each group's trajectories
    for g, group in enumerate(groups):
        try:
            checked.append(check_group(group, group_label(group, g)))
        except MalformedTrajectoryError as err:
            checked.append(err)
    # Read ahead a chunk at a time, in the order the loop below takes the trajectories.
    step_runs = batch_step_runs((t for ts in checked if isinstance(ts, list) for t in ts), config)
    for g, (group, trajectories) in enumerate(zip(groups, checked, strict=True)):
        if isinstance(trajectories, MalformedTrajectoryError):
            drop(trajectories)
            continue
        group_advantages = trajectory_advantages[g] if trajectory_advantages is not None else None
        if group_advantages is not None and len(group_advantages) != len(trajectories):
            raise ValueError(
                f"{group_label(group, g)}: {len(group_advantages)} advantages for "
                f"{len(trajectories)} trajectories"
            )
        for t, trajectory in enumerate(trajectories):
            advantage = group_advantages[t] if group_advantages is not None else NO_ADVANTAGE
            runs = next(step_runs)
            try:
                traj_rows, num_steps = trajectory_rows(group, t, trajectory, config, advantage, runs)
            except MalformedTrajectoryError as err:
                drop(err)
                continue
            rows += traj_rows
            steps_per_traj.append(num_steps)
            rows_per_traj.append(len(traj_rows))
    if not rows:
        detail = f" (first: {dropped[0]})" if dropped else ""
        raise EmptyBatchError(f"no trainable rows: {len(dropped)} trajectories dropped as malformed{detail}")
    # Each row's outcome reward goes on its last token, always a model token: SkyRL's GAE reads it there.
    fields = build_rows(
        config.pad_token_id, [row.spec() for row in rows], logprobs=True, advantages=needs_advantages
    )
    fields["action_log_probs"] = fields["rollout_logprobs"].clone()
    batch = TrainingInputBatch(fields)
    batch.metadata = {
        "uids": [row.group_id for row in rows],
        "row_ids": [row.row_id for row in rows],
        "response_length": fields["response_mask"].shape[1],
    }
    batch = pad_to_multiple(batch, config.dp_size)
    stats = BatchStats(
        num_pad_rows=batch.metadata["pad_size"],
        dropped_malformed=len(dropped),
        drop_reasons=tuple(str(err) for err in dropped),
        drop_fields=tuple(err.field_name for err in dropped),
        steps_per_traj=tuple(steps_per_traj),
        rows_per_traj=tuple(rows_per_traj),
        response_lengths=tuple(row.response_length for row in rows),
        action_token_ratios=tuple(row.model_tokens / row.response_length for row in rows),
    )
    return batch, stats


def _sft_pair(label: str, example: Any, max_seq_len: int | None, vocab_size: int | None) -> RowSpec:
    if not isinstance(example, list | tuple) or len(example) != 2:
        raise MalformedTrajectoryError(
            label, None, "example", f"is {example!r:.40}", "pass (prompt_ids, response_ids) pairs"
        )
    ids = IdLists(vocab_size)
    for name, value in (("prompt_ids", example[0]), ("response_ids", example[1])):
        ids.read(label, None, name, value)
        ids.check_last(label, None, name)
    tokens = ids.values()  # the prompt, then the response
    n_prompt = ids.bounds[1]
    if not n_prompt or n_prompt == len(tokens):
        empty = "prompt_ids" if not n_prompt else "response_ids"
        raise MalformedTrajectoryError(label, None, empty, f"empty {empty}", "every example needs both parts")
    if max_seq_len is not None and len(tokens) > max_seq_len:
        problem = f"{len(tokens)} tokens, more than max_seq_len={max_seq_len}"
        remedy = "truncate the example or raise max_seq_len"
        raise MalformedTrajectoryError(label, None, "sequence", problem, remedy)
    return RowSpec(tokens, n_prompt, [Span(0, len(tokens) - n_prompt)])


def sft_examples_to_batch(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    pad_token_id: int,
    dp_size: int = 1,
    max_seq_len: int | None = None,
    vocab_size: int | None = None,
    loss_reduction: str = "token_mean",
) -> TrainingInputBatch:
    """``(prompt_ids, response_ids)`` pairs -> a ``cross_entropy`` batch (loss on response tokens only).

    SkyRL's ``cross_entropy`` loss is a masked sum: ``loss_reduction="token_mean"`` scales
    ``loss_mask`` by 1 / (response tokens in the batch), as SkyRL's SFT ``DefaultCollator`` does, so
    the summed loss is a per-token mean across micro-batches and DP ranks; ``"sum"`` keeps 0/1.
    """
    if loss_reduction not in ("token_mean", "sum"):
        raise ValueError(f"loss_reduction must be 'token_mean' or 'sum', got {loss_reduction!r}")
    if not examples:
        raise EmptyBatchError("no SFT examples")
    rows = [
        _sft_pair(f"SFT example {i}", example, max_seq_len, vocab_size) for i, example in enumerate(examples)
    ]
    fields = build_rows(pad_token_id, rows, logprobs=False, advantages=False)
    if loss_reduction == "token_mean":
        fields["loss_mask"] /= fields["loss_mask"].sum().clamp(min=1.0)
    kept = ("sequences", "attention_mask", "response_mask", "loss_mask")
    batch = TrainingInputBatch({key: fields[key] for key in kept})
    batch.metadata = {
        "uids": [f"sft:{i}" for i in range(len(rows))],
        "row_ids": [f"SFT example {i}" for i in range(len(rows))],
        "response_length": fields["response_mask"].shape[1],
    }
    return pad_to_multiple(batch, dp_size)
