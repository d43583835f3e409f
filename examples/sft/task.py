"""The addition task: "what is A plus B?" -> (A + B) mod 10, as SFT pairs (parquet) and as RL rows.

GRPO needs some rollouts to score before it can learn anything. A random-init model answers with
the right digit about one time in ten and in the right format far less often, so from scratch a
few dozen RL steps barely move it. Supervised pairs teach the mapping directly; RL started from
the SFT export begins with most answers right. Held-out pairs (never trained on) measure whether
SFT learned addition or only the pairs it saw.

Rewards and answer format are the digit task's (``examples/simple_math/task.py``): the completion
must start with exactly the answer digit.
"""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd

from examples.simple_math.task import digit_reward, reward_fn

DATA_SOURCE = "addition_mod10"
Pair = tuple[int, int]

__all__ = [
    "DATA_SOURCE",
    "digit_reward",
    "make_rows",
    "read_sft_parquet",
    "reward_fn",
    "split_pairs",
    "write_sft_parquet",
]


def question(a: int, b: int) -> str:
    return f"what is {a} plus {b}?"


def answer(a: int, b: int) -> str:
    return str((a + b) % 10)


def split_pairs(num_heldout: int, seed: int = 0) -> tuple[list[Pair], list[Pair]]:
    """All 100 (A, B) digit pairs, split into training pairs and ``num_heldout`` held-out pairs."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    return sorted(pairs[num_heldout:]), sorted(pairs[:num_heldout])


def write_sft_parquet(path: str | Path, pairs: list[Pair]) -> Path:
    """One row per pair: ``prompt`` (the user message) and ``response`` (the assistant's answer)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(
        {
            "prompt": [question(a, b) for a, b in pairs],
            "response": [answer(a, b) for a, b in pairs],
            "data_source": DATA_SOURCE,
        }
    )
    frame.to_parquet(path, index=False)
    return path


def read_sft_parquet(path: str | Path) -> list[tuple[str, str]]:
    frame = pd.read_parquet(path, columns=["prompt", "response"])
    return list(zip(frame["prompt"], frame["response"], strict=True))


def make_rows(num_rows: int, seed: int = 0) -> list[dict]:
    """RL task rows over all 100 pairs, in the digit task's row format."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append(
            {
                "id": f"add-{index}",
                "question": question(a, b),
                "answer": answer(a, b),
                "data_source": DATA_SOURCE,
            }
        )
    return rows
