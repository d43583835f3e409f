"""The digit task: "what is A?" -> the digit A. A random-init model starts at chance (~0).

The prompt spells the digit as " A" (a different BPE token from the bare answer digit), so the
model must learn a mapping rather than copy a token. Reward is 1 when the completion starts with
exactly the digit: "7" and "7<|im_end|>" score, "71", " 7" and "x7" do not.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rllm_skyrl import rllm_names

DATA_SOURCE = "digit_echo"
_LEADING_NUMBER = re.compile(r"\d+")


def make_rows(num_rows: int, seed: int = 0, digits: range = range(10)) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        digit = rng.choice(list(digits))
        rows.append(
            {
                "id": f"digit-{index}",
                "question": f"what is {digit}?",
                "answer": str(digit),
                "data_source": DATA_SOURCE,
            }
        )
    return rows


def reward_fn(task: dict, text: str) -> float:
    match = _LEADING_NUMBER.match(text)
    return float(match is not None and match.group(0) == task["answer"])


def digit_reward(task: dict, action: Any) -> Any:
    """``reward_fn`` as an rLLM reward function: ``(task, action) -> RewardOutput``."""
    reward = reward_fn(task, getattr(action, "action", action) or "")
    return rllm_names.RewardOutput(reward=reward, is_correct=reward > 0)
