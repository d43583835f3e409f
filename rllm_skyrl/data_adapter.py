"""Trajectory groups (and SFT pairs) -> SkyRL ``TrainingInputBatch``: where episodes become tensors.

Pure data processing: no Ray, no network, no files. Inputs are read by attribute, so rLLM's
pydantic types and ``rllm_skyrl.types`` both work:
``TrajectoryGroup(trajectories, group_id="task:role", metadata=[{task_id, rollout_idx}, ...])``,
``Trajectory(uid, name=role, steps, reward)``,
``Step(prompt_ids, response_ids, logprobs, reward, advantage, metadata)``.

Row layout is SkyRL's (``skyrl/train/dataset/preprocess.py``, built by its own
``convert_prompts_responses_to_batch_tensors``): ``sequences`` left-padded
``[PAD | prompt | response]``, response-level tensors right-aligned ``[B, response_len]``.

Multi-turn merging: a step whose prompt starts with everything the row holds so far (previous
prompt + previous responses) continues that row. The extra prompt tokens are observations
(``loss_mask`` 0, logprob 0, advantage 0); its response tokens are model tokens (``loss_mask`` 1).
A step that does not extend the row starts a new one. Steps are first split by
``metadata["lineage_id"]`` (a sub-agent's turns never extend its parent's), as rLLM's transforms do.

Keys written for the FSDP workers (``workers/worker.py`` ``_forward_backward_micro`` via
``BaseBatchIterator.batch_to_experience``): ``sequences``, ``attention_mask``, ``response_mask``,
``loss_mask``, ``rewards``, ``rollout_logprobs``, ``action_log_probs`` and, when known,
``advantages``. ``action_log_probs`` (the loss's "old" policy) start as the sampler's logprobs,
which is Tinker's convention; a backend that wants a proximal policy overwrites them with
``dispatch.forward("policy", batch)``. ``values``/``returns`` (critic) and
``base_action_log_probs`` (KL to a reference) are added later by whoever computes them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

from rllm_skyrl.batch_layout import pad_to_multiple, right_aligned
from rllm_skyrl.trajectory_checks import (
    MalformedTrajectoryError,
    check_tokens,
    check_trajectory,
    step_fields,
    token_ids,
    trajectory_label,
    trajectory_reward,
)


class EmptyBatchError(ValueError):
    """Nothing trainable is left (every trajectory was dropped); the caller should skip the update."""


@dataclass(frozen=True)
class BatchConfig:
    """How trajectories become rows. Built once from the run config.

    ``dp_size``: the batch is padded to a multiple of it with copies of row 0 whose ``loss_mask`` is
    all 0 (SkyRL's ``pad_training_input_batch``). Policy losses are masked sums, so those rows add
    nothing. Losses that average over rows (SkyRL's critic loss, the KL term) count them as zero
    rows, which scales those terms by real/padded rows (at most ``dp_size - 1`` extra rows).
    ``drop_malformed``: drop a bad trajectory and count it instead of raising.
    ``use_precomputed_advantages``: read ``step.advantage`` (a float or one value per response
    token) instead of a per-trajectory scalar, as rLLM's ``use_precomputed_advantage`` does.
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


@dataclass
class _Row:
    """One training row under construction; lists are aligned with ``response_ids``."""

    label: str
    group_id: str
    prompt_ids: list[int]
    first_step: int
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    last_step: int = 0

    def extended_by(self, prompt_ids: list[int]) -> bool:
        """Whether a step with this prompt continues the row (its prompt starts with the row so far)."""
        held = self.length
        return (
            len(prompt_ids) >= held
            and prompt_ids[: len(self.prompt_ids)] == self.prompt_ids
            and prompt_ids[len(self.prompt_ids) : held] == self.response_ids
        )

    def append(
        self,
        step_index: int,
        observation_ids: list[int],
        response_ids: list[int],
        logprobs: list[float],
        advantages: list[float],
    ) -> None:
        """Observations are context (mask 0); the step's sampled tokens are what we train on (mask 1)."""
        n_obs = len(observation_ids)
        self.response_ids += observation_ids + response_ids
        self.loss_mask += [0] * n_obs + [1] * len(response_ids)
        self.logprobs += [0.0] * n_obs + logprobs
        self.advantages += [0.0] * n_obs + advantages
        self.last_step = step_index

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def step_span(self) -> str:
        if self.first_step == self.last_step:
            return f"step {self.first_step}"
        return f"steps {self.first_step}-{self.last_step}"

    @property
    def row_id(self) -> str:
        return f"{self.label} {self.step_span}"


def _lineages(steps: Sequence[Any]) -> list[list[tuple[int, Any]]]:
    """Steps split by ``metadata["lineage_id"]`` in first-seen order; untagged steps share one lineage."""
    by_lineage: dict[Any, list[tuple[int, Any]]] = {}
    for index, step in enumerate(steps):
        lineage = (getattr(step, "metadata", None) or {}).get("lineage_id")
        by_lineage.setdefault(lineage, []).append((index, step))
    return list(by_lineage.values())


def _trajectory_rows(
    group: Any, traj_index: int, config: BatchConfig, advantage: float | None, needs_advantages: bool
) -> list[_Row]:
    """Validate one trajectory and merge its steps into rows; raises ``MalformedTrajectoryError``."""
    trajectory = group.trajectories[traj_index]
    label = trajectory_label(group, traj_index)
    check_trajectory(trajectory, label, config, advantage)
    rows: list[_Row] = []
    for lineage in _lineages(trajectory.steps):
        row: _Row | None = None
        for index, step in lineage:
            prompt_ids, response_ids, logprobs, advantages = step_fields(
                label, index, step, config, advantage, needs_advantages
            )
            if row is not None and row.extended_by(prompt_ids):
                observation_ids = prompt_ids[row.length :]
            else:
                if not prompt_ids:
                    raise MalformedTrajectoryError(
                        label, index, "prompt_ids", "empty prompt", "a row needs at least one prompt token"
                    )
                row = _Row(label=label, group_id=group.group_id, prompt_ids=prompt_ids, first_step=index)
                rows.append(row)
                observation_ids = []
            row.append(index, observation_ids, response_ids, logprobs, advantages)
            if config.max_seq_len is not None and row.length > config.max_seq_len:
                raise MalformedTrajectoryError(
                    label,
                    index,
                    "sequence",
                    f"the row built from {row.step_span} has {row.length} tokens, "
                    f"more than max_seq_len={config.max_seq_len}",
                    "raise max_seq_len or cap the rollout's prompt and response lengths",
                )
    return rows


def trajectory_groups_to_batch(
    groups: Sequence[Any],
    config: BatchConfig,
    trajectory_advantages: Sequence[Sequence[float]] | None = None,
) -> tuple[TrainingInputBatch, BatchStats]:
    """Turn trajectory groups into one padded ``TrainingInputBatch`` plus conversion stats.

    ``trajectory_advantages[g][t]`` is the scalar advantage of trajectory ``t`` of group ``g``
    (e.g. ``compute_group_advantages(...).advantages_by_group``), broadcast to its model tokens.
    Leave it ``None`` to build a batch without advantages (GAE adds them after the critic's
    forward) or when ``config.use_precomputed_advantages`` reads them from the steps.

    ``metadata``: ``uids`` (group id per row: SkyRL's prompt identity, contiguous), ``row_ids``
    (who a row came from, for error messages), ``response_length``, ``pad_size``.
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
    rows: list[_Row] = []
    rewards: list[float] = []
    steps_per_traj: list[int] = []
    rows_per_traj: list[int] = []
    drop_reasons: list[str] = []
    for g, group in enumerate(groups):
        group_advantages = trajectory_advantages[g] if trajectory_advantages is not None else None
        if group_advantages is not None and len(group_advantages) != len(group.trajectories):
            raise ValueError(
                f"group '{group.group_id}': {len(group_advantages)} advantages for "
                f"{len(group.trajectories)} trajectories"
            )
        for t, trajectory in enumerate(group.trajectories):
            advantage = float(group_advantages[t]) if group_advantages is not None else None
            try:
                traj_rows = _trajectory_rows(group, t, config, advantage, needs_advantages)
            except MalformedTrajectoryError as err:
                if not config.drop_malformed:
                    raise
                drop_reasons.append(str(err))
                continue
            rows += traj_rows
            rewards += [trajectory_reward(trajectory) or 0.0] * len(traj_rows)
            steps_per_traj.append(len(trajectory.steps))
            rows_per_traj.append(len(traj_rows))
    if not rows:
        detail = f" (first: {drop_reasons[0]})" if drop_reasons else ""
        raise EmptyBatchError(
            f"no trainable rows: {len(drop_reasons)} trajectories dropped as malformed{detail}"
        )

    # The outcome reward sits on each row's last token, which is always a model token; SkyRL's
    # GAE reads rewards per token from there.
    token_rewards = [
        [0.0] * (len(row.response_ids) - 1) + [reward] for row, reward in zip(rows, rewards, strict=True)
    ]
    sequences, attention_mask, response_mask, rewards_BT, loss_mask, logprobs_BT, _, _ = (
        convert_prompts_responses_to_batch_tensors(
            config.pad_token_id,
            [row.prompt_ids for row in rows],
            [row.response_ids for row in rows],
            token_rewards,
            [row.loss_mask for row in rows],
            [row.logprobs for row in rows],
        )
    )
    fields = {
        "sequences": sequences,
        "attention_mask": attention_mask,
        "response_mask": response_mask,
        "loss_mask": loss_mask,
        "rewards": rewards_BT,
        "rollout_logprobs": logprobs_BT,
        "action_log_probs": logprobs_BT.clone(),
    }
    if needs_advantages:
        fields["advantages"] = right_aligned([row.advantages for row in rows], response_mask.shape[1])
    batch = TrainingInputBatch(fields)
    batch.metadata = {
        "uids": [row.group_id for row in rows],
        "row_ids": [row.row_id for row in rows],
        "response_length": response_mask.shape[1],
    }
    batch = pad_to_multiple(batch, config.dp_size)
    stats = BatchStats(
        num_pad_rows=batch.metadata["pad_size"],
        dropped_malformed=len(drop_reasons),
        drop_reasons=tuple(drop_reasons),
        steps_per_traj=tuple(steps_per_traj),
        rows_per_traj=tuple(rows_per_traj),
        response_lengths=tuple(len(row.response_ids) for row in rows),
        action_token_ratios=tuple(sum(row.loss_mask) / len(row.loss_mask) for row in rows),
    )
    return batch, stats


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

    SkyRL's ``cross_entropy`` loss is a masked sum. ``loss_reduction="token_mean"`` scales
    ``loss_mask`` by 1 / (response tokens in the batch), as SkyRL's SFT ``DefaultCollator`` does, so
    the summed loss is a per-token mean across micro-batches and DP ranks; ``"sum"`` keeps 0/1.
    """
    if loss_reduction not in ("token_mean", "sum"):
        raise ValueError(f"loss_reduction must be 'token_mean' or 'sum', got {loss_reduction!r}")
    if not examples:
        raise EmptyBatchError("no SFT examples")
    prompts, responses = [], []
    for i, (prompt, response) in enumerate(examples):
        prompt_ids, response_ids = token_ids(prompt), token_ids(response)
        label = f"SFT example {i}"
        if not prompt_ids or not response_ids:
            empty = "prompt_ids" if not prompt_ids else "response_ids"
            raise MalformedTrajectoryError(
                label, None, empty, f"empty {empty}", "every example needs both parts"
            )
        if max_seq_len is not None and len(prompt_ids) + len(response_ids) > max_seq_len:
            raise MalformedTrajectoryError(
                label,
                None,
                "response_ids",
                f"{len(prompt_ids) + len(response_ids)} tokens, more than max_seq_len={max_seq_len}",
                "truncate the example or raise max_seq_len",
            )
        check_tokens(label, None, "prompt_ids", prompt_ids, vocab_size)
        check_tokens(label, None, "response_ids", response_ids, vocab_size)
        prompts.append(prompt_ids)
        responses.append(response_ids)
    loss_masks = [[1] * len(r) for r in responses]
    sequences, attention_mask, response_mask, _, loss_mask, _, _, _ = (
        convert_prompts_responses_to_batch_tensors(
            pad_token_id, prompts, responses, [[0.0] * len(r) for r in responses], loss_masks
        )
    )
    if loss_reduction == "token_mean":
        loss_mask = loss_mask / loss_mask.sum().clamp(min=1.0)
    batch = TrainingInputBatch(
        {
            "sequences": sequences,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
        }
    )
    batch.metadata = {
        "uids": [f"sft:{i}" for i in range(len(prompts))],
        "row_ids": [f"SFT example {i}" for i in range(len(prompts))],
        "response_length": response_mask.shape[1],
    }
    return pad_to_multiple(batch, dp_size)
