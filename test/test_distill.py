"""On-policy distillation's pieces on this backend: rLLM's per-token advantages reach SkyRL's batch
unchanged, ``distill/reverse_kl`` is the sampled KL estimate, a teacher that cannot score the student
is refused in one line, and rLLM's ``DistillationWorkflow`` episodes always carry their rewards."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import Step, Trajectory, group_of

from rllm_skyrl.data.adapter import BatchConfig, trajectory_groups_to_batch
from rllm_skyrl.errors import UserFacingError
from rllm_skyrl.rollout.teacher import check_teacher
from rllm_skyrl.update.advantages import distill_metrics

distill = pytest.importorskip("rllm.trainer.distill")
PAD = 0


def distillation_groups(
    seed: int = 0,
) -> tuple[list, list[list[float]], list[tuple[list[float], list[float]]]]:
    """Groups of student steps whose advantages rLLM computed from teacher and student logprobs."""
    rng = random.Random(seed)
    groups, advantages, logprobs = [], [], []
    for task in range(3):
        trajectories = []
        for _ in range(4):
            length = rng.randint(1, 5)
            student = [rng.uniform(-8.0, -0.01) for _ in range(length)]
            teacher = [rng.uniform(-12.0, -0.01) for _ in range(length)]
            advantage = distill.compute_distill_reverse_kl(teacher, student, float("-inf"), float("inf"))
            prompt = [rng.randint(1, 300) for _ in range(rng.randint(2, 6))]
            response = [rng.randint(1, 300) for _ in range(length)]
            step = Step(prompt, response, logprobs=student, reward=None, advantage=advantage)
            trajectories.append(Trajectory([step], reward=None, name="student"))
            advantages.append(advantage)
            logprobs.append((teacher, student))
        groups.append(group_of(*trajectories, task=f"task-{task}"))
    return groups, advantages, logprobs


def test_per_token_advantages_reach_the_training_batch_unchanged():
    groups, advantages, _ = distillation_groups()
    config = BatchConfig(pad_token_id=PAD, dp_size=5, use_precomputed_advantages=True)  # 12 rows + 3 pad rows
    batch, _ = trajectory_groups_to_batch(groups, config)
    for row, expected in enumerate(advantages):
        window = batch["advantages"][row][batch["response_mask"][row].bool()]
        assert torch.equal(window, torch.tensor(expected, dtype=window.dtype))
        assert batch["advantages"][row][~batch["response_mask"][row].bool()].abs().sum() == 0
    assert batch["loss_mask"][len(advantages) :].sum() == 0  # DP padding rows (copies) train nothing


def test_reverse_kl_metric_is_the_mean_of_student_minus_teacher():
    groups, _, logprobs = distillation_groups(seed=1)
    terms = [s - t for teacher, student in logprobs for t, s in zip(teacher, student, strict=True)]
    metrics = distill_metrics(groups)
    assert metrics["distill/tokens"] == len(terms)
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(terms) / len(terms), abs=1e-12)
    scalar = group_of(Trajectory([Step([1], [2], reward=None, advantage=0.5)], reward=None))
    assert distill_metrics([scalar]) == {}  # one advantage per step: not a distillation's


@pytest.fixture(scope="module")
def tokenizers(tiny_tokenizer):
    """The student's tokenizer and another one (a byte-level BPE of another size)."""
    from rllm_skyrl.tiny_model import build_tokenizer

    other = build_tokenizer(384)
    assert other.get_vocab() != tiny_tokenizer.get_vocab()
    return tiny_tokenizer, other


def teacher_engine(tokenizer, parser: str = "qwen"):
    from rllm.engine.rollout.openai_engine import OpenAIEngine
    from rllm.parser import ChatTemplateParser
    from rllm.parser.chat_template_parser import QwenChatTemplateParser

    chat_parser = QwenChatTemplateParser(tokenizer) if parser == "qwen" else ChatTemplateParser(tokenizer)
    return OpenAIEngine(
        model="teacher",
        tokenizer=tokenizer,
        chat_parser=chat_parser,
        base_url="http://127.0.0.1:9/v1",
        api_key="x",
    )


def test_a_teacher_with_another_tokenizer_is_refused_when_ids_are_shared(tokenizers):
    student, other = tokenizers
    args = {"teacher_engine": teacher_engine(other), "shared_tokenizer": True}
    with pytest.raises(UserFacingError, match="shared_tokenizer=True, but the teacher's tokenizer") as error:
        check_teacher(args, student)
    assert "\n" not in str(error.value) and "shared_tokenizer=False" in str(error.value)
    check_teacher({**args, "shared_tokenizer": False}, student)  # rLLM aligns the two by text
    check_teacher({**args, "teacher_engine": teacher_engine(student)}, student)


def test_a_teacher_engine_that_cannot_answer_is_refused(tokenizers):
    student, _ = tokenizers
    with pytest.raises(UserFacingError, match="cannot parse completions"):
        check_teacher(
            {"teacher_engine": teacher_engine(student, parser="generic"), "shared_tokenizer": True}, student
        )
    from rllm.engine.rollout.openai_engine import OpenAIEngine

    without = OpenAIEngine(model="teacher", base_url="http://127.0.0.1:9/v1", api_key="x")
    with pytest.raises(UserFacingError, match="has no tokenizer"):
        check_teacher({"teacher_engine": without, "shared_tokenizer": True}, student)


def test_distillation_episodes_carry_rewards_however_they_end(tiny_tokenizer):
    """Finished and length-cut rollouts both leave with trajectory rewards (compat.rllm_distill_rewards)."""
    from rllm.engine import ModelOutput
    from rllm.rewards.reward_types import RewardOutput
    from rllm.workflows.distillation_workflow import DistillationWorkflow

    from rllm_skyrl import compat

    compat.apply(["rllm_distill_rewards"])

    class Student:  # a rollout engine that answers "7", finished or cut at max tokens
        tokenizer, chat_parser, is_validation = tiny_tokenizer, None, True

        def __init__(self, finish_reason: str):
            self.finish_reason = finish_reason

        async def get_model_response(self, messages, **kwargs):
            return ModelOutput(text="7", content="7", reasoning="", finish_reason=self.finish_reason)

    rewards = []
    for finish_reason in ("stop", "length"):
        workflow = DistillationWorkflow(
            Student(finish_reason),
            reward_function=lambda task, text: RewardOutput(reward=float(text == "7")),
            executor=ThreadPoolExecutor(1),
        )
        episode = asyncio.run(workflow.run_with_termination_handling({"question": "what is 7?"}, "u:0"))
        rewards.append(episode.trajectories[0].reward)
    assert rewards == [1.0, 1.0]
