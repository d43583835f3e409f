"""The real rLLM drives the backend: its config, ``UnifiedTrainer``, ``AgentTrainer``, workflows and data.

Every run here composes rLLM's packaged ``unified`` config with ``rllm/backend=skyrl`` and trains the
tiny model through SkyRL's workers on CPU. The on-policy learning curve is ``slow``; the fully-async one,
with stale rollouts and TIS, is in test_off_policy_correction.py.
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
from rllm_harness import (
    DIGITS,
    RecordingBackend,
    digit_reward,
    digit_rows,
    last_mean,
    learning_digits,
    requests_during,
    requires_rllm,
    rllm_config,
    run_rllm,
    syncs_by_hook,
)

from examples.simple_math.task import DATA_SOURCE, reward_fn
from rllm_skyrl import rllm_api as rllm_compat
from rllm_skyrl.run.metrics_file import read_metrics
from rllm_skyrl.update import advantages

pytestmark = [requires_rllm, pytest.mark.usefixtures("ray_cluster")]


def unified_trainer(
    cfg, workflow_class, workflow_args, train, val=None, backend_cls=RecordingBackend, **kwargs
):
    from rllm.trainer.unified_trainer import UnifiedTrainer

    return UnifiedTrainer(
        backend_cls=backend_cls,
        config=cfg,
        workflow_class=workflow_class,
        workflow_args=workflow_args,
        train_dataset=train,
        val_dataset=val,
        **kwargs,
    )


def fit(trainer) -> None:
    try:
        trainer.fit()
    finally:
        trainer.shutdown()


# ------------------------------------------------------------------ advantages: ours equal rLLM's


@pytest.mark.parametrize("estimator", advantages.ESTIMATORS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_standalone_estimators_equal_rllms(estimator, norm_by_std):
    """The standalone trainer's estimators give rLLM's numbers on random groups (sizes 1..6)."""
    from rllm.trainer.algorithms.advantage import get_rllm_adv_estimator
    from rllm.trainer.algorithms.config import AlgorithmConfig

    rng = np.random.default_rng(7)
    config = AlgorithmConfig(norm_adv_by_std_in_grpo=norm_by_std)
    for _ in range(25):
        groups = [
            rng.choice([0.0, 0.5, 1.0, 2.0], size=rng.integers(1, 7)) for _ in range(rng.integers(1, 6))
        ]
        theirs, _ = get_rllm_adv_estimator(estimator)(groups, config)
        ours = advantages.outcome_advantages(groups, estimator, norm_by_std=norm_by_std)
        for expected, got in zip(theirs, ours, strict=True):
            np.testing.assert_allclose(got.numpy(), np.asarray(expected, dtype=float), rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------ task rows


def test_task_ids_follow_rllm():
    """Task objects keep their id, dict rows their "id", rows without one get a fresh uuid."""
    from rllm.data.utils import interleave_tasks
    from rllm.types import Task

    rows = [Task(id="t-1", instruction="q"), {"id": "d-2", "question": "q"}, {"question": "no id"}]
    tasks, ids = rllm_compat.task_ids(rows, 3)
    theirs_tasks, theirs_ids = interleave_tasks(rows, 3)
    assert tasks == theirs_tasks and ids[:6] == theirs_ids[:6] == ["t-1"] * 3 + ["d-2"] * 3
    assert len(set(ids[6:])) == 1 and uuid.UUID(ids[6])  # one fresh uuid for the three repeats


# ------------------------------------------------------------------ training runs


@pytest.mark.slow
def test_agent_trainer_trains_validates_and_logs_like_tinker(tmp_path):
    """rLLM's AgentTrainer(backend="skyrl"), SimpleWorkflow and DatasetRegistry rows, 3 steps.

    Also: an estimator registered through rLLM's registry takes effect for its role; metric names
    and definitions are tinker's; metrics.jsonl, metrics.png and the summary appear under rLLM.
    """
    from rllm.data.dataset import DatasetRegistry
    from rllm.trainer import AgentTrainer
    from rllm.trainer.algorithms.advantage import RLLM_ADV_ESTIMATOR_REGISTRY, register_rllm_adv_estimator
    from rllm.workflows.simple_workflow import SimpleWorkflow

    from rllm_skyrl import rllm_plugin

    @register_rllm_adv_estimator("always_one_for_test")
    def always_one(rewards, algorithm_config, **kwargs):
        ones = [np.ones_like(r, dtype=float) for r in rewards]
        return ones, ones

    DatasetRegistry.register_dataset(DATA_SOURCE, digit_rows(48), "train")
    DatasetRegistry.register_dataset(DATA_SOURCE, digit_rows(8, seed=1), "test")
    cfg = rllm_config(
        tmp_path,
        *DIGITS,
        "training.group_size=4",
        "validation.group_size=2",
        "data.train_batch_size=4",
        "rllm.trainer.total_batches=3",
        "rllm.trainer.test_freq=2",
    )
    rllm_plugin.register()
    try:
        trainer = AgentTrainer(
            config=cfg,
            workflow_class=SimpleWorkflow,
            workflow_args={"reward_function": digit_reward},
            train_dataset=DatasetRegistry.load_dataset(DATA_SOURCE, "train"),
            val_dataset=DatasetRegistry.load_dataset(DATA_SOURCE, "test"),
            backend="skyrl",
            traj_group_adv_estimator_map={"default_traj_name_0": "always_one_for_test"},
        )
        trainer.train()
    finally:
        rllm_plugin.unregister()
        RLLM_ADV_ESTIMATOR_REGISTRY.pop("always_one_for_test", None)

    records = read_metrics(tmp_path / "run")
    train = [r for r in records if "progress/batch" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for record in train:
        assert record["advantage/default_traj_name_0/mean"] == 1.0  # the registered estimator ran
        assert record["time/step"] > 0 and record["progress/batch"] == record["step"]
        assert record["train/kl_sample_train_v1"] >= 0 and record["train/kl_sample_train_v2"] >= 0
        assert math.isclose(record["train/perplexity"], math.exp(record["train/entropy"]), rel_tol=1e-5)
        assert record["reward/mean"] == record["reward/default_traj_name_0/mean"]
    val = [r for r in records if "val/digit_echo/pass@1" in r]
    assert val and not any("val/unknown/pass@1" in r for r in records)
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 0


@pytest.mark.slow
def test_fully_async_syncs_once_per_update_while_rollouts_go_on(tmp_path):
    """Fully-async: one weight sync per on_policy_updated at the trainer's weight_version, none in
    on_batch_end; requests finish while a forward-backward runs (nothing blocks the event loop)."""
    from rllm.workflows.simple_workflow import SimpleWorkflow

    cfg = rllm_config(
        tmp_path,
        *DIGITS,
        "training.group_size=4",
        "rllm.async_training.enable=true",
        "rllm.async_training.mini_batch_size=8",
        "rllm.async_training.fwd_bwd_group_size=2",
        "rllm.async_training.staleness_threshold=1.0",
        "rllm.workflow.raise_on_error=false",
        "rllm.trainer.total_batches=4",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.val_before_train=false",
    )
    backend = run_rllm(cfg, SimpleWorkflow, {"reward_function": digit_reward}, digit_rows(64))
    updates = [shape for name, shape in backend.calls if name == "on_policy_updated"]
    assert len(updates) == 3  # rLLM's async loop stops one step before total_batches
    assert syncs_by_hook(backend) == {"on_policy_updated": [u["weight_version"] for u in updates]}
    assert [u["weight_version"] for u in updates] == [1, 2, 3]
    assert requests_during(backend) > 0


def _digit_env_class():
    from rllm.environments.base.base_env import BaseEnv

    class DigitEnv(BaseEnv):
        def __init__(self, turns: int = 2):
            self.turns = turns

        def reset(self, task=None):
            self.task = dict(task.metadata) if hasattr(task, "metadata") else dict(task)
            self.turn = 0
            return self.task["question"], {}

        def step(self, action):
            self.turn += 1
            reward = reward_fn(self.task, str(getattr(action, "action", action)))
            return f"again: {self.task['question']}", reward, self.turn >= self.turns, {}

        @staticmethod
        def from_dict(info):
            return DigitEnv(**info)

    return DigitEnv


def _python_tool_env_class():
    """An environment whose observation is rLLM's local Python interpreter running the answer."""
    from rllm.environments.base.base_env import BaseEnv
    from rllm.tools.code_tools.python_interpreter import PythonInterpreter

    class PythonToolEnv(BaseEnv):
        def __init__(self):
            self.tool = PythonInterpreter(backend="local")

        def reset(self, task=None):
            self.task, self.turn = dict(task), 0
            return self.task["question"], {}

        def step(self, action):
            self.turn += 1
            output = self.tool(code=str(getattr(action, "action", action)))
            reward = reward_fn(self.task, str(getattr(action, "action", action)))
            return str(output)[:200], reward, self.turn >= 2, {}

        @staticmethod
        def from_dict(info):
            return PythonToolEnv()

    return PythonToolEnv


def _text_agent_class():
    """An rLLM ``BaseAgent`` that keeps only what the workflow gives it: the response text."""
    from rllm.agents.agent import Action, BaseAgent, Step, Trajectory

    class TextAgent(BaseAgent):
        def __init__(self):
            self.reset()

        def reset(self):
            self.messages: list[dict] = []
            self._trajectory = Trajectory()

        @property
        def chat_completions(self):
            return self.messages

        @property
        def trajectory(self):
            return self._trajectory

        def update_from_env(self, observation, reward, done, info, **kwargs):
            if self._trajectory.steps:
                self._trajectory.steps[-1].reward = reward
            if observation and not done:
                self.messages.append({"role": "user", "content": str(observation)})

        def update_from_model(self, response, **kwargs):
            self.messages.append({"role": "assistant", "content": response})
            step = Step(chat_completions=list(self.messages), model_response=response, action=response)
            self._trajectory.steps.append(step)
            return Action(action=response)

    return TextAgent


@pytest.mark.slow
@pytest.mark.parametrize("workflow", ["CumulativeWorkflow", "MultiTurnWorkflow"])
def test_rllm_agent_env_workflows_train(tmp_path, workflow):
    """rLLM's own multi-turn workflows hand the agent only text; the backend restores the sampled
    tokens of every step and trains on them. Cumulative renders prompts with rLLM's chat parser and
    reads Task rows (``load_dataset(as_tasks=True)``); the other turns a tool from rLLM."""
    from rllm.data.dataset import DatasetRegistry
    from rllm.parser.chat_template_parser import QwenChatTemplateParser
    from rllm.workflows import cumulative_workflow, multi_turn_workflow

    if workflow == "CumulativeWorkflow":
        DatasetRegistry.register_dataset("digit_tasks", digit_rows(8), "train")
        train = DatasetRegistry.load_dataset("digit_tasks", "train", as_tasks=True)
        workflow_class = cumulative_workflow.CumulativeWorkflow
        env_cls = _digit_env_class()
    else:
        train = digit_rows(8)
        workflow_class = multi_turn_workflow.MultiTurnWorkflow
        env_cls = _python_tool_env_class()
    cfg = rllm_config(
        tmp_path,
        *DIGITS,
        "data.max_response_length=24",
        "data.max_prompt_length=256",
        "training.group_size=2",
        "data.train_batch_size=2",
        "rllm.trainer.total_batches=2",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.val_before_train=false",
    )
    workflow_args = {"agent_cls": _text_agent_class(), "env_cls": env_cls, "max_steps": 2}
    backend = run_rllm(cfg, workflow_class, workflow_args, train)
    assert isinstance(backend.rollout_engine.chat_parser, QwenChatTemplateParser)
    train_records = [r for r in read_metrics(tmp_path / "run") if "progress/batch" in r]
    assert len(train_records) == 2
    for record in train_records:
        assert record["batch/steps_restored_from_rollouts"] > 0 and record["batch/steps_without_tokens"] == 0
        assert (
            record["batch/num_rows"] > 0 and record["train/loss"] == record["train/loss"]
        )  # trained, finite


@pytest.mark.slow
def test_bad_rollouts_follow_rllms_error_handling(tmp_path):
    """A workflow that raises for one task and a NaN reward for another: rLLM retries and records the
    failure; the backend drops (and counts) the broken trajectory instead of training on it, and
    without drop_malformed the error names the episode."""
    from rllm.workflows.simple_workflow import SimpleWorkflow

    def flaky_reward(task, action):
        if task["id"] == "digit-1":
            raise RuntimeError("reward service down")
        result = digit_reward(task, action)
        if task["id"] == "digit-2":
            result.reward = float("nan")
        return result

    overrides = [
        *DIGITS,
        "training.group_size=2",
        "data.train_batch_size=4",
        "rllm.trainer.total_batches=1",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.val_before_train=false",
        "rllm.workflow.raise_on_error=false",
        "rllm.workflow.retry_limit=1",
    ]
    rows = digit_rows(4)
    run_rllm(
        rllm_config(tmp_path / "drop", *overrides, "training.drop_malformed=true"),
        SimpleWorkflow,
        {"reward_function": flaky_reward},
        rows,
    )
    (record,) = read_metrics(tmp_path / "drop" / "run")
    assert record["batch/termination_reason/error"] > 0  # rLLM recorded the failed rollouts
    assert record["batch/dropped_malformed_sequences"] == 2  # the two NaN-reward rollouts
    assert record["batch/num_rows"] >= 4

    with pytest.raises(Exception, match=r"episode 'digit-2:\d'.*reward"):
        run_rllm(
            rllm_config(tmp_path / "strict", *overrides),
            SimpleWorkflow,
            {"reward_function": flaky_reward},
            rows,
        )


@pytest.mark.slow
def test_standalone_trainer_calls_the_backend_as_rllm_does(tmp_path):
    """The same config under rLLM's UnifiedTrainer and the standalone one: the same hook calls, in the
    same order, with the same argument shapes (sync mode; validation before, during and after)."""
    from rllm.workflows.simple_workflow import SimpleWorkflow

    from rllm_skyrl.standalone import UnifiedTrainer as StandaloneTrainer

    overrides = [
        *DIGITS,
        "training.group_size=2",
        "validation.group_size=2",
        "data.train_batch_size=2",
        "data.val_batch_size=2",
        "rllm.trainer.total_batches=2",
        "rllm.trainer.test_freq=1",
        "rllm.trainer.val_before_train=true",
    ]
    train, val = digit_rows(8), digit_rows(2, seed=1)
    real = unified_trainer(
        rllm_config(tmp_path / "rllm", *overrides),
        SimpleWorkflow,
        {"reward_function": digit_reward},
        train,
        val,
    )
    fit(real)
    ours = StandaloneTrainer(
        backend_cls=RecordingBackend,
        config=rllm_config(tmp_path / "ours", *overrides),
        workflow_class=SimpleWorkflow,
        workflow_args={"reward_function": digit_reward},
        train_dataset=train,
        val_dataset=val,
    )
    fit(ours)

    def comparable(calls):  # the algorithm config's class differs by design (rLLM's vs ours)
        return [(name, {k: v for k, v in shape.items() if k != "algorithm_config"}) for name, shape in calls]

    assert comparable(ours.backend.calls) == comparable(real.backend.calls)


# ------------------------------------------------------------------ learning (slow)


def _learning_overrides(start_model: str, *extra: str) -> list[str]:
    return [
        *learning_digits(start_model),
        "training.group_size=32",
        "validation.group_size=4",
        "data.train_batch_size=16",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.val_before_train=false",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a hang guard: ~1 min on a quiet machine, 25+ min on a loaded 2-core one
def test_on_policy_learns_the_digit_task(tmp_path, partly_taught_model):
    from rllm.workflows.simple_workflow import SimpleWorkflow

    steps = 45  # past 0.8 by ~step 32
    overrides = _learning_overrides(partly_taught_model, f"rllm.trainer.total_batches={steps}")
    cfg = rllm_config(tmp_path, *overrides)
    run_rllm(cfg, SimpleWorkflow, {"reward_function": digit_reward}, digit_rows(4096))
    records = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    print("\nreward per step:", " ".join(f"{r['reward/mean']:.2f}" for r in records))
    assert len(records) == steps
    assert last_mean(records[:10], "reward/mean") <= 0.3
    assert last_mean(records, "reward/mean") >= 0.8
    # Trainer and server hold the same policy at every step of a run whose weights move a lot.
    gaps = [r["train/logprob_abs_diff/mean"] for r in records if "train/logprob_abs_diff/mean" in r]
    assert max(gaps) < 1e-3, "rollout and trainer disagree on the policy"
