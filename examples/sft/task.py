"""The successor task: "what comes after A?" -> (A + 1) mod 10, asked in six phrasings.

A random-init model answers it at chance. As SFT data each row is a ``messages`` conversation; the
held-out rows pair a digit with a phrasing never seen together in training (each digit is trained
in the five other phrasings, each phrasing on other digits), so a right held-out answer means the
model learned the mapping, not the rows. As RL rows the same questions go to the digit task's
workflow and reward (the completion must start with exactly the answer digit).
"""

from __future__ import annotations

import random

from examples.simple_math.task import digit_reward, reward_fn

DATA_SOURCE = "successor"
PHRASINGS = (
    "what comes after {a}?",
    "which digit follows {a}?",
    "next digit after {a}?",
    "successor of {a}?",
    "count on from {a}: ?",
    "{a} plus one, mod ten?",
)

__all__ = ["DATA_SOURCE", "PHRASINGS", "digit_reward", "make_rows", "messages_rows", "reward_fn", "split"]

Item = tuple[int, int]  # (digit, phrasing index)


def question(digit: int, phrasing: int) -> str:
    return PHRASINGS[phrasing].format(a=digit)


def answer(digit: int) -> str:
    return str((digit + 1) % 10)


def split() -> tuple[list[Item], list[Item]]:
    """Training items and held-out items: digit d is held out in phrasing d mod 6."""
    items = [(d, p) for d in range(10) for p in range(len(PHRASINGS))]
    heldout = [(d, d % len(PHRASINGS)) for d in range(10)]
    return [item for item in items if item not in heldout], heldout


def messages_rows(items: list[Item]) -> list[dict]:
    """rLLM's SFT rows: one user question and the assistant's answer each."""
    return [
        {
            "messages": [
                {"role": "user", "content": question(d, p)},
                {"role": "assistant", "content": answer(d)},
            ]
        }
        for d, p in items
    ]


def make_rows(num_rows: int, seed: int = 0) -> list[dict]:
    """RL task rows over every digit and phrasing, in the digit task's row format."""
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        d, p = rng.randrange(10), rng.randrange(len(PHRASINGS))
        rows.append(
            {
                "id": f"succ-{index}",
                "question": question(d, p),
                "answer": answer(d),
                "data_source": DATA_SOURCE,
            }
        )
    return rows
