"""Tokens/s of the data adapter (episodes -> ``TrainingInputBatch``) vs the per-token path it replaced.

The baseline is the previous implementation, kept here: every id through ``int()`` and a vocabulary
check in Python, every logprob through ``float()`` and ``math.isfinite``, rows merged as Python
lists and laid out by SkyRL's own ``convert_prompts_responses_to_batch_tensors``. The new path is
``trajectory_groups_to_batch``. Both convert the same episodes at a GPU run's shape (64 groups x 8
trajectories, 1,024 prompt + 3,072 response tokens per row), single-turn and 4 turns with
observation tokens between them; every list is a fresh Python list, as a tokenizer or the engine's
JSON hands them over. Runs alternate between the two sides so background load hits both alike;
the median of ``--repeats`` runs is reported, in wall-clock and in this process's CPU time (the
fairer number on a machine shared with other work; the load average is printed), and the two
batches are checked to be bit-identical.

    python -m bench.bench_adapter [--repeats 5] [--groups 64] [--per-group 8]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

import numpy as np
import torch
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

from rllm_skyrl.data.adapter import BatchConfig, trajectory_groups_to_batch
from rllm_skyrl.data.batch_layout import pad_to_multiple, right_aligned
from rllm_skyrl.records import Step, Trajectory, TrajectoryGroup

VOCAB = 151_936  # Qwen-sized
WIDTHS = (6, 12, 10, 17, 12, 10)


def make_groups(
    groups: int, per_group: int, prompt: int, response: int, turns: int, observation: int, seed: int = 0
) -> list[TrajectoryGroup]:
    """``turns`` steps per trajectory; step k's prompt is the conversation so far plus an observation."""
    rng = np.random.default_rng(seed)
    observation = observation if turns > 1 else 0
    per_turn = (response - observation * (turns - 1)) // turns
    out = []
    for g in range(groups):
        trajectories = []
        for t in range(per_group):
            sequence, steps = rng.integers(2, VOCAB, prompt), []
            for turn in range(turns):
                prompt_ids = np.concatenate([sequence, rng.integers(2, VOCAB, observation if turn else 0)])
                response_ids = rng.integers(2, VOCAB, per_turn)
                logprobs = -3.0 * rng.random(per_turn)
                steps.append(Step(prompt_ids.tolist(), response_ids.tolist(), logprobs.tolist()))
                sequence = np.concatenate([prompt_ids, response_ids])
            trajectories.append(Trajectory(uid=f"g{g}t{t}", name="solver", steps=steps, reward=float(t % 2)))
        metadata = [{"task_id": f"task{g}", "rollout_idx": i} for i in range(per_group)]
        out.append(TrajectoryGroup(trajectories, group_id=f"task{g}:solver", metadata=metadata))
    return out


# ------------------------------------------------------------------------------------- baseline


def _baseline_step(step: Any, vocab_size: int) -> tuple[list[int], list[int], list[float]]:
    prompt_ids, response_ids = [int(t) for t in step.prompt_ids], [int(t) for t in step.response_ids]
    for ids in (prompt_ids, response_ids):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} outside the vocabulary")
    logprobs = [float(x) for x in step.logprobs]
    if len(logprobs) != len(response_ids) or not all(math.isfinite(x) for x in logprobs):
        raise ValueError("bad logprobs")
    return prompt_ids, response_ids, logprobs


def baseline_to_batch(
    groups: list[TrajectoryGroup], config: BatchConfig, advantages: list[list[float]]
) -> TrainingInputBatch:
    """The previous implementation's work for valid episodes: Python per token, SkyRL's builder."""
    rows, uids, row_ids = [], [], []
    for group, group_advantages in zip(groups, advantages, strict=True):
        for t, trajectory in enumerate(group.trajectories):
            advantage = float(group_advantages[t])
            if not math.isfinite(float(trajectory.reward)):
                raise ValueError("bad reward")
            row = None
            for index, step in enumerate(trajectory.steps):
                prompt_ids, response_ids, logprobs = _baseline_step(step, config.vocab_size)
                held = None if row is None else len(row["prompt"]) + len(row["response"])
                extends = (
                    row is not None
                    and len(prompt_ids) >= held
                    and prompt_ids[: len(row["prompt"])] == row["prompt"]
                    and prompt_ids[len(row["prompt"]) : held] == row["response"]
                )
                if not extends:
                    row = {"prompt": prompt_ids, "response": [], "mask": [], "logprobs": [], "adv": []}
                    rows.append((row, float(trajectory.reward)))
                    uids.append(group.group_id)
                    row_ids.append(f"{group.group_id}:{t} step {index}")
                    held = len(prompt_ids)
                observation = prompt_ids[held:]
                n_obs, n = len(observation), len(response_ids)
                row["response"] += observation + response_ids
                row["mask"] += [0] * n_obs + [1] * n
                row["logprobs"] += [0.0] * n_obs + logprobs
                row["adv"] += [0.0] * n_obs + [advantage] * n
    token_rewards = [[0.0] * (len(row["response"]) - 1) + [reward] for row, reward in rows]
    sequences, attention_mask, response_mask, rewards, loss_mask, logprobs, _, _ = (
        convert_prompts_responses_to_batch_tensors(
            config.pad_token_id,
            [row["prompt"] for row, _ in rows],
            [row["response"] for row, _ in rows],
            token_rewards,
            [row["mask"] for row, _ in rows],
            [row["logprobs"] for row, _ in rows],
        )
    )
    batch = TrainingInputBatch(
        {
            "sequences": sequences,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
            "rewards": rewards,
            "rollout_logprobs": logprobs,
            "action_log_probs": logprobs.clone(),
            "advantages": right_aligned([row["adv"] for row, _ in rows], response_mask.shape[1]),
        }
    )
    batch.metadata = {"uids": uids, "row_ids": row_ids, "response_length": response_mask.shape[1]}
    return pad_to_multiple(batch, config.dp_size)


# ------------------------------------------------------------------------------------------ main


def measure(groups: list[TrajectoryGroup], repeats: int) -> tuple[dict[str, dict[str, float]], int]:
    """Median wall-clock and CPU seconds per conversion, per side, after checking both agree."""
    config = BatchConfig(pad_token_id=0, dp_size=8, max_seq_len=8192, vocab_size=VOCAB)
    advantages = [[0.5 - (t % 2) for t in range(len(g.trajectories))] for g in groups]
    new, _ = trajectory_groups_to_batch(groups, config, advantages)
    old = baseline_to_batch(groups, config, advantages)
    assert sorted(new.keys()) == sorted(old.keys())
    for key in old.keys():
        assert new[key].dtype == old[key].dtype and torch.equal(new[key], old[key]), f"{key} differs"
    assert new.metadata["uids"] == old.metadata["uids"]
    tokens = int(new["attention_mask"].sum())
    times: dict[str, dict[str, list[float]]] = {side: {"wall": [], "cpu": []} for side in ("baseline", "new")}
    for _ in range(repeats):
        for side, convert in (
            ("baseline", lambda: baseline_to_batch(groups, config, advantages)),
            ("new", lambda: trajectory_groups_to_batch(groups, config, advantages)),
        ):
            wall, cpu = time.perf_counter(), time.process_time()
            convert()
            times[side]["cpu"].append(time.process_time() - cpu)
            times[side]["wall"].append(time.perf_counter() - wall)
    medians = {side: {k: statistics.median(v) for k, v in t.items()} for side, t in times.items()}
    return medians, tokens


def line(first: str, *cells: str) -> None:
    print(f"{first:<14}" + "".join(f"{cell:>{width}}" for cell, width in zip(cells, WIDTHS, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=3072)
    parser.add_argument("--observation", type=int, default=224, help="observation tokens between turns")
    args = parser.parse_args()
    rows = args.groups * args.per_group
    print(f"{rows} rows x ({args.prompt} prompt + {args.response} response tokens), median of {args.repeats}")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    line("shape", "clock", "baseline s", "new s", "baseline Mtok/s", "new Mtok/s", "speed-up")
    for turns in (1, 4):
        groups = make_groups(args.groups, args.per_group, args.prompt, args.response, turns, args.observation)
        medians, tokens = measure(groups, args.repeats)
        for clock in ("wall", "cpu"):
            old, new = medians["baseline"][clock], medians["new"][clock]
            line(
                "single-turn" if turns == 1 else f"{turns} turns",
                clock,
                f"{old:.3f}",
                f"{new:.3f}",
                f"{tokens / old / 1e6:.1f}",
                f"{tokens / new / 1e6:.1f}",
                f"{old / new:.1f}x",
            )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    print("batches bit-identical to the baseline: yes")


if __name__ == "__main__":
    main()
