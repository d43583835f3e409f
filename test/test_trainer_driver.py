"""The fallback trainer's loop, workflows, grouping and dataloader, against a recording backend.

The rollout engine here is a deterministic in-process stand-in: these tests are about the
loop's contract (rLLM's call order, grouping, failure handling, resume), not about a model.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
from typing import Any

import pytest
from omegaconf import OmegaConf

from rllm_skyrl import rllm_api
from rllm_skyrl.records import (
    Episode,
    ModelOutput,
    RewardOutput,
    Step,
    TerminationReason,
    Trajectory,
    TrajectoryGroup,
)
from rllm_skyrl.run.metrics_file import MetricsSink, read_metrics
from rllm_skyrl.standalone import (
    SimpleWorkflow,
    StatefulTaskDataLoader,
    UnifiedTrainer,
    Workflow,
    WorkflowEngine,
)
from rllm_skyrl.standalone.driver import console_line
from rllm_skyrl.standalone.episodes import group_trajectories

# --------------------------------------------------------------------------- fakes


def _tokens(text: str) -> list[int]:
    return [ord(c) for c in text]


def _template(messages: list[dict[str, Any]]) -> str:
    return "".join(f"{m['role']}:{m['content']}\n" for m in messages) + "assistant:"


class ScriptedEngine:
    """Answers each question from a per-question script, cycling; tokens are character codes."""

    def __init__(self, script: dict[str, list[str]] | None = None, finish_reason: str = "stop") -> None:
        self.script = script or {}
        self.finish_reason = finish_reason
        self.calls: dict[str, int] = {}
        self.in_flight = self.max_in_flight = 0
        self.is_validation = False
        self.weight_version = 0

    async def get_model_response(self, messages: list[dict[str, Any]], **kwargs: Any) -> ModelOutput:
        question = messages[0]["content"]
        count = self.calls.get(question, 0)
        self.calls[question] = count + 1
        answers = self.script.get(question, ["42"])
        answer = answers[count % len(answers)]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0)
        self.in_flight -= 1
        completion = _tokens(answer + "\n")
        return ModelOutput(
            text=answer,
            content=answer,
            reasoning="",
            prompt_ids=_tokens(_template(messages)),
            completion_ids=completion,
            logprobs=[-0.5] * len(completion),
            finish_reason=self.finish_reason,
            weight_version=self.weight_version,
        )


def exact_match(task: dict[str, Any], action: Any) -> RewardOutput:
    reward = float(action.action.strip() == str(task["answer"]))
    return RewardOutput(reward=reward, is_correct=reward > 0)


class RecordingBackend:
    """Records every hook call; optionally fails in update_policy or resumes in on_train_start."""

    def __init__(self, config, fail_update_at: int | None = None, resume: dict | None = None, **kwargs):
        self.config = config
        self.calls: list[str] = []
        self.init_kwargs: dict[str, Any] = {}
        self.trained_groups: list[list[TrajectoryGroup]] = []
        self.train_batches: list[list[str]] = []
        self.fail_update_at = fail_update_at
        self.resume = resume
        self.checkpoints: list[dict] = []

    def validate_config(self) -> None:
        self.calls.append("validate_config")

    def init_rollout_engine(self, **kwargs: Any) -> ScriptedEngine:
        self.calls.append("init_rollout_engine")
        self.init_kwargs = kwargs
        self.rollout_engine = ScriptedEngine(self.config.get("script"))
        return self.rollout_engine

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    async def generate_episodes(self, batch, agent_workflow_engine, is_validation=False, **kwargs):
        self.calls.append("generate_episodes(val)" if is_validation else "generate_episodes")
        if not is_validation:
            self.train_batches.append([task["id"] for task in batch])
        rollout = self.config.rllm.rollout
        tasks, task_ids = rllm_api.task_ids(batch, rollout.n_val if is_validation else rollout.n)
        episodes = await agent_workflow_engine.execute_tasks(tasks, task_ids, is_validation=is_validation)
        for episode, task in zip(episodes, tasks, strict=True):  # as SkyRLBackend (and rLLM's verl) do
            episode.metadata["data_source"] = task["data_source"]
        return episodes

    def transform_to_backend_batch(self, trainer_state, **kwargs):
        self.calls.append("transform_to_backend_batch")
        self.trained_groups.append(trainer_state.trajectory_groups)
        return [g.group_id for g in trainer_state.trajectory_groups]

    async def process_backend_batch(self, trainer_state, **kwargs):
        self.calls.append("process_backend_batch")

    async def compute_advantages(self, trainer_state, algorithm_config, **kwargs):
        self.calls.append("compute_advantages")
        trainer_state.metrics["train/kl"] = 0.01 * trainer_state.global_step

    async def update_policy(self, trainer_state, **kwargs):
        self.calls.append("update_policy")
        if trainer_state.global_step == self.fail_update_at:
            raise RuntimeError("optimizer blew up")

    async def on_train_start(self, trainer_state):
        self.calls.append("on_train_start")
        if self.resume is not None:
            trainer_state.global_step = self.resume["global_step"]
            trainer_state.train_dataloader.load_state_dict(self.resume["dataloader"])

    async def on_train_end(self, trainer_state):
        self.calls.append("on_train_end")

    async def on_epoch_start(self, trainer_state):
        self.calls.append("on_epoch_start")

    async def on_epoch_end(self, trainer_state):
        self.calls.append("on_epoch_end")

    async def on_batch_start(self, trainer_state):
        self.calls.append("on_batch_start")

    async def on_batch_end(self, trainer_state):
        self.calls.append("on_batch_end")
        self.checkpoints.append(
            {
                "global_step": trainer_state.global_step,
                "dataloader": trainer_state.train_dataloader.state_dict(),
            }
        )

    async def on_validation_start(self, trainer_state):
        self.calls.append("on_validation_start")
        return True

    async def on_validation_end(self, trainer_state):
        self.calls.append("on_validation_end")


def make_config(tmp_path, **rllm_overrides: Any):
    base = {
        "rllm": {
            "data": {"train_batch_size": 2, "val_batch_size": -1, "seed": 7},
            "trainer": {
                "total_epochs": 1,
                "total_batches": -1,
                "test_freq": 0,
                "val_before_train": False,
                "logger": [],
            },
            "rollout": {"n": 3, "n_val": 2},
            "workflow": {"n_parallel_tasks": 4},
        }
    }
    return OmegaConf.merge(OmegaConf.create(base), OmegaConf.create({"rllm": rllm_overrides}))


def math_rows(n: int, source: str = "toy") -> list[dict[str, Any]]:
    return [{"id": f"t{i}", "question": f"q{i}", "answer": "42", "data_source": source} for i in range(n)]


def recorded(trainer: UnifiedTrainer, run_dir) -> UnifiedTrainer:
    """What ``training_run`` attaches to every trainer's logger: ``metrics.jsonl`` in ``run_dir``."""
    trainer.logger.add_sinks({"metrics_jsonl": MetricsSink(run_dir, lambda: None)})
    return trainer


def make_trainer(tmp_path, train=None, val=None, backend_args=None, workflow=SimpleWorkflow, **overrides):
    trainer = UnifiedTrainer(
        backend_cls=RecordingBackend,
        config=make_config(tmp_path, **overrides),
        workflow_class=workflow,
        train_dataset=train,
        val_dataset=val,
        workflow_args={"reward_function": exact_match},
        backend_args=backend_args,
    )
    return recorded(trainer, tmp_path / "run")


STEP_CALLS = [
    "on_batch_start",
    "generate_episodes",
    "transform_to_backend_batch",
    "process_backend_batch",
    "compute_advantages",
    "update_policy",
    "on_batch_end",
]
VAL_CALLS = ["on_validation_start", "generate_episodes(val)", "on_validation_end"]


# --------------------------------------------------------------------------- trainer


def test_call_order_matches_rllm_on_policy_mode(tmp_path):
    trainer = make_trainer(tmp_path, train=math_rows(4))
    trainer.fit()
    trainer.shutdown()
    assert trainer.backend.calls == [
        "validate_config",
        "init_rollout_engine",
        "on_train_start",
        "on_epoch_start",
        *STEP_CALLS,
        *STEP_CALLS,
        "on_epoch_end",
        "on_train_end",
        "shutdown",
    ]
    kwargs = trainer.backend.init_kwargs
    assert set(kwargs) == {
        "cf_config",
        "transform_config",
        "rs_config",
        "algorithm_config",
        "total_training_steps",
    }
    assert kwargs["total_training_steps"] == 2 and kwargs["algorithm_config"] is None  # the run config's
    assert trainer.backend.config is trainer.config  # the FULL config, not a section


def test_validation_runs_before_training_every_test_freq_and_after_the_last_step(tmp_path):
    trainer = make_trainer(
        tmp_path,
        train=math_rows(6),
        val=math_rows(2, source="held_out"),
        trainer={"test_freq": 2, "val_before_train": True, "total_epochs": 2, "total_batches": 5},
    )
    trainer.fit()
    calls = trainer.backend.calls
    assert calls[:7] == [
        "validate_config",
        "init_rollout_engine",
        "on_train_start",
        *VAL_CALLS,
        "on_epoch_start",
    ]
    # rLLM's schedule: 3 batches per epoch, 5 steps; validation after steps 2 and 4, not after the
    # step that reaches total_batches, and once more when training ends.
    expected = [*STEP_CALLS, *STEP_CALLS, *VAL_CALLS, *STEP_CALLS, "on_epoch_end", "on_epoch_start"]
    expected += [*STEP_CALLS, *VAL_CALLS, *STEP_CALLS, "on_epoch_end", *VAL_CALLS, "on_train_end"]
    assert calls[7:] == expected
    steps = [r["step"] for r in read_metrics(tmp_path / "run")]
    assert steps == [0, 1, 2, 2, 3, 4, 4, 5, 5]  # validation is logged as its own record


class SkipValidationBackend(RecordingBackend):
    async def on_validation_start(self, trainer_state):
        self.calls.append("on_validation_start")
        return False


def test_validation_is_skipped_when_the_backend_declines(tmp_path):
    trainer = UnifiedTrainer(
        backend_cls=SkipValidationBackend,
        config=make_config(tmp_path, trainer={"test_freq": 1}),
        workflow_class=SimpleWorkflow,
        train_dataset=math_rows(2),
        val_dataset=math_rows(2),
        workflow_args={"reward_function": exact_match},
    )
    recorded(trainer, tmp_path / "run").fit()
    trainer.shutdown()
    assert trainer.backend.calls[3:-2] == [
        "on_epoch_start",
        *STEP_CALLS,
        "on_validation_start",
        "on_epoch_end",
        "on_validation_start",
    ]
    assert not any(key.startswith("val/") for key in read_metrics(tmp_path / "run")[0])


def test_a_failing_step_ends_in_on_train_end_as_in_rllm(tmp_path):
    """rLLM's trainer does not call on_batch_end for a step that raised; on_train_end always runs."""
    trainer = make_trainer(tmp_path, train=math_rows(4), backend_args={"fail_update_at": 1})
    with pytest.raises(RuntimeError, match="optimizer blew up"):
        trainer.fit()
    assert trainer.backend.calls[-2:] == ["update_policy", "on_train_end"]


class SolverJudgeWorkflow(Workflow):
    """Two roles per episode: a solver answers, a judge grades the solver."""

    async def run(self, task, uid, **kwargs):
        solver_out = await self.rollout_engine.get_model_response(
            [{"role": "user", "content": task["question"]}]
        )
        solved = float(solver_out.content == task["answer"])
        judge_prompt = [{"role": "user", "content": f"judge {task['question']}: {solver_out.content}"}]
        judge_out = await self.rollout_engine.get_model_response(judge_prompt)
        judge_right = float((judge_out.content == "yes") == bool(solved))
        return Episode(
            trajectories=[
                Trajectory(
                    name="solver", steps=[Step(model_output=solver_out, reward=solved)], reward=solved
                ),
                Trajectory(name="judge", steps=[Step(model_output=judge_out, reward=judge_right)]),
            ],
            is_correct=bool(solved),
            termination_reason=TerminationReason.ENV_DONE,
        )


def test_trajectories_are_grouped_by_task_and_role(tmp_path):
    config_script = {
        "q0": ["42", "7", "42"],
        "q1": ["7"],
        "judge q0: 42": ["yes"],
        "judge q0: 7": ["no"],
        "judge q1: 7": ["yes"],  # wrong: the judge approves a wrong answer
    }
    trainer = UnifiedTrainer(
        backend_cls=RecordingBackend,
        config=OmegaConf.merge(make_config(tmp_path), {"script": config_script}),
        workflow_class=SolverJudgeWorkflow,
        train_dataset=math_rows(2),
    )
    recorded(trainer, tmp_path / "run").fit()
    (groups,) = trainer.backend.trained_groups
    assert sorted(g.group_id for g in groups) == ["t0:judge", "t0:solver", "t1:judge", "t1:solver"]
    for group in groups:
        assert len(group.trajectories) == 3  # rllm.rollout.n
        assert group.group_role in ("solver", "judge")
        assert [m["rollout_idx"] for m in group.metadata] == ["0", "1", "2"]
    by_id = {g.group_id: g for g in groups}
    assert [t.reward for t in by_id["t0:solver"].trajectories] == [1.0, 0.0, 1.0]
    # The judge left Trajectory.reward unset: it is taken from the last step.
    assert [t.reward for t in by_id["t0:judge"].trajectories] == [1.0, 1.0, 1.0]
    (record,) = read_metrics(tmp_path / "run")
    # As with rLLM's trainer, reward/time/progress metrics are the backend's (test_backend.py).
    assert record["groups/num_groups"] == 4 and record["train/kl"] == 0.01


def test_validation_logs_pass_at_k_per_data_source(tmp_path):
    val = math_rows(2, source="held_out")
    trainer = make_trainer(
        tmp_path, val=val, trainer={"val_before_train": True, "val_only": True}, rollout={"n_val": 2, "n": 1}
    )
    trainer.backend.rollout_engine.script = {"q0": ["42", "0"], "q1": ["0"]}
    trainer.fit()
    assert trainer.backend.calls[-1] == "on_validation_end"  # val_only: no training, as in rLLM
    (record,) = read_metrics(tmp_path / "run")
    assert record["step"] == 0
    assert record["val/held_out/pass@1"] == pytest.approx(1 / 4)
    assert record["val/held_out/pass@2"] == pytest.approx(1 / 2)
    assert record["val/reward/default_traj_name_0/mean"] == pytest.approx(1 / 4)


def test_resume_from_a_checkpoint_continues_the_exact_data_order(tmp_path):
    full = make_trainer(tmp_path / "full", train=math_rows(6), trainer={"total_epochs": 2})
    full.fit()
    assert len(full.backend.train_batches) == 6

    for completed in range(1, 6):  # crash after `completed` steps, then resume from that checkpoint
        checkpoint = full.backend.checkpoints[completed - 1]
        resumed = make_trainer(
            tmp_path / f"resume{completed}",
            train=math_rows(6),
            trainer={"total_epochs": 2},
            backend_args={"resume": checkpoint},
        )
        resumed.fit()
        assert resumed.backend.train_batches == full.backend.train_batches[completed:]
        assert [c["global_step"] for c in resumed.backend.checkpoints] == list(range(completed + 1, 7))


class FlakyWorkflow(SimpleWorkflow):
    async def run(self, task, uid, **kwargs):
        if task["id"] == "t1":
            raise ConnectionError("env crashed")
        return await super().run(task, uid, **kwargs)


def test_a_failing_workflow_becomes_a_counted_error_episode(tmp_path):
    trainer = make_trainer(tmp_path, train=math_rows(2), workflow=FlakyWorkflow)
    trainer.fit()
    assert "update_policy" in trainer.backend.calls
    (groups,) = trainer.backend.trained_groups
    assert [g.group_id for g in groups] == ["t0:default_traj_name_0"]
    (record,) = read_metrics(tmp_path / "run")
    assert record["batch/termination_reason/error"] == pytest.approx(0.5)
    assert record["batch/termination_reason/env_done"] == pytest.approx(0.5)
    assert record["batch/default_traj_name_acc"] == 1.0  # SimpleWorkflow's metric, as rLLM names it


def test_what_needs_rllm_or_a_full_batch_is_refused_before_the_backend_starts(tmp_path):
    with pytest.raises(ValueError, match="needs rLLM's trainer"):
        make_trainer(tmp_path, train=math_rows(2), async_training={"enable": True})
    with pytest.raises(ValueError, match="fewer than"):
        make_trainer(tmp_path, train=math_rows(1))


def test_console_line_shows_the_key_metrics():
    metrics = {"reward/mean": 0.4123, "val/math/pass@1": 0.3, "train/kl": 0.00123, "time/step": 1.844}
    assert (
        console_line(3, 20, metrics)
        == "step 3/20 | reward 0.412 | val/math/pass@1 0.300 | kl 0.00123 | 1.84 s/step"
    )


# --------------------------------------------------------------------------- workflows


def run(coro):
    return asyncio.run(coro)


def test_workflow_engine_ids_order_and_concurrency_bound():
    engine = ScriptedEngine()
    workflows = WorkflowEngine(SimpleWorkflow, {"reward_function": exact_match}, engine, n_parallel_tasks=2)
    tasks, task_ids = rllm_api.task_ids(math_rows(3), 4)
    episodes = run(workflows.execute_tasks(tasks, task_ids, is_validation=True))
    assert [e.id for e in episodes] == [f"t{t}:{r}" for t in range(3) for r in range(4)]
    # 12 rollouts, 2 at a time: the bound is reached and never passed.
    assert engine.is_validation and engine.max_in_flight == 2
    step = episodes[0].trajectories[0].steps[0]
    assert step.prompt_ids == _tokens("user:q0\nassistant:") and step.response_ids == _tokens("42\n")
    assert len(step.logprobs) == len(step.response_ids) and step.weight_version == 0


def test_workflow_engine_can_raise_after_retries():
    workflows = WorkflowEngine(
        FlakyWorkflow, {"reward_function": exact_match}, ScriptedEngine(), retry_limit=2
    )
    episodes = run(workflows.execute_tasks(math_rows(2), ["t0", "t1"]))
    assert episodes[1].termination_reason == TerminationReason.ERROR
    assert episodes[1].metadata["error"]["error_type"] == "ConnectionError"
    workflows.raise_on_error = True
    with pytest.raises(RuntimeError, match="rollout t1:0 failed 2 times"):
        run(workflows.execute_tasks(math_rows(2), ["t0", "t1"]))


class StuckWorkflow(Workflow):
    async def run(self, task, uid, **kwargs):
        await asyncio.sleep(10)


def test_a_workflow_past_its_timeout_ends_as_timeout():
    workflows = WorkflowEngine(StuckWorkflow, {"timeout": 0.01}, ScriptedEngine())
    (episode,) = run(workflows.execute_tasks(math_rows(1), ["t0"]))
    assert episode.id == "t0:0" and episode.termination_reason == TerminationReason.TIMEOUT


def test_simple_workflow_reports_truncation():
    engine = ScriptedEngine(finish_reason="length")
    episode = run(SimpleWorkflow(engine, exact_match).run(math_rows(1)[0], "t0:0"))
    assert episode.termination_reason == TerminationReason.MAX_RESPONSE_LENGTH_EXCEEDED
    assert episode.is_correct and episode.trajectories[0].reward == 1.0


def _episode_fields(workflow_cls, answer: str) -> dict[str, Any]:
    """What a trainer and the backend read of the episode ``workflow_cls`` makes for ``answer``."""
    task = math_rows(1)[0]
    workflow = workflow_cls(ScriptedEngine({"q0": [answer]}), exact_match, executor=None)
    workflow.reset(task=task, uid="t0:0")
    episode = run(workflow.run_with_termination_handling(task, "t0:0"))
    (trajectory,) = episode.trajectories
    (step,) = trajectory.steps
    return {
        "id": episode.id,
        "is_correct": episode.is_correct,
        "termination_reason": getattr(episode.termination_reason, "value", episode.termination_reason),
        "metrics": episode.metrics,
        "name": trajectory.name,
        "reward": trajectory.reward,
        "tokens": (step.prompt_ids, step.response_ids, step.logprobs, step.reward),
    }


@pytest.mark.skipif(importlib.util.find_spec("rllm") is None, reason="rLLM is not installed")
@pytest.mark.parametrize("ours", ["stand-in SimpleWorkflow", "the quickstart's workflow"])
def test_workflows_make_the_episode_rllms_simple_workflow_makes(ours):
    """On the same engine and reward function, rLLM's SimpleWorkflow and each of ours (the stand-in;
    the quickstart's, here over rLLM's Workflow and records) give a trainer and the backend the same."""
    from rllm.workflows.simple_workflow import SimpleWorkflow as RLLMSimpleWorkflow

    from examples.simple_math.workflow import AskOnceWorkflow

    workflow_cls = SimpleWorkflow if ours == "stand-in SimpleWorkflow" else AskOnceWorkflow
    for answer in ("42", "7"):
        assert _episode_fields(workflow_cls, answer) == _episode_fields(RLLMSimpleWorkflow, answer)


# --------------------------------------------------------------------------- records and grouping


def test_step_rejects_logprobs_that_do_not_match_the_tokens():
    with pytest.raises(ValueError, match="2 logprobs for 3 response tokens"):
        Step(response_ids=[1, 2, 3], logprobs=[-1.0, -1.0])


def test_ids_with_colons_split_at_the_last_one():
    episode = Episode(id="gsm8k:17:3")
    assert (episode.task_id, episode.rollout_idx) == ("gsm8k:17", "3")
    assert TrajectoryGroup([], group_id="gsm8k:17:judge").group_role == "judge"
    assert TrajectoryGroup([]).group_role == "all_groups"


def test_grouping_imputes_names_takes_step_rewards_and_drops_groups_of_one():
    def trajectory(reward, name="default_traj_name", steps=1):
        return Trajectory(name=name, steps=[Step(reward=0.5)] * steps, reward=reward)

    episodes = [
        Episode(id="a:0", trajectories=[trajectory(1.0), trajectory(None, "judge"), trajectory(1.0, "x", 0)]),
        Episode(id="a:1", trajectories=[trajectory(0.0), trajectory(None, "judge")]),
        Episode(id="b:0", trajectories=[trajectory(1.0)]),
    ]
    groups, metrics = group_trajectories(episodes)
    assert [g.group_id for g in groups] == ["a:default_traj_name_0", "a:judge"]
    assert [t.reward for t in groups[1].trajectories] == [0.5, 0.5]
    assert metrics["batch/groups_dropped_insufficient_trajs"] == 1  # b's only trajectory


# --------------------------------------------------------------------------- dataloader


@pytest.mark.parametrize(("n_rows", "batch_size", "drop_last"), [(10, 3, True), (10, 3, False), (8, 4, True)])
def test_dataloader_resume_reproduces_the_exact_order(n_rows, batch_size, drop_last):
    rows = [{"id": i} for i in range(n_rows)]

    def take(loader, n_batches):
        out = []
        while len(out) < n_batches:
            for batch in loader:
                out.append([r["id"] for r in batch])
                if len(out) == n_batches:
                    break
        return out

    reference = take(StatefulTaskDataLoader(rows, batch_size, seed=3, drop_last=drop_last), 12)
    per_epoch = n_rows // batch_size if drop_last else math.ceil(n_rows / batch_size)
    epochs = [sum(reference[e * per_epoch : (e + 1) * per_epoch], []) for e in range(12 // per_epoch)]
    for order in epochs:  # each epoch hands out distinct rows, in a shuffled order
        assert len(order) == len(set(order)) == (per_epoch * batch_size if drop_last else n_rows)
    assert epochs[0] != sorted(epochs[0]), "the first epoch is in row order: not shuffled"
    assert epochs[1] != epochs[0], "every epoch must be reshuffled"
    other_seed = take(StatefulTaskDataLoader(rows, batch_size, seed=4, drop_last=drop_last), per_epoch)
    assert sum(other_seed, []) != epochs[0], "the seed must change the order"
    for stop in range(1, 12):
        first = StatefulTaskDataLoader(rows, batch_size, seed=3, drop_last=drop_last)
        head = take(first, stop)
        state = first.state_dict()
        assert set(state) == {"epoch", "cursor", "seed"}
        second = StatefulTaskDataLoader(rows, batch_size, seed=99, drop_last=drop_last)
        second.load_state_dict(state)  # the saved seed wins
        assert head + take(second, 12 - stop) == reference


def test_dataloader_refuses_a_position_outside_its_rows():
    with pytest.raises(ValueError, match="different dataset"):
        StatefulTaskDataLoader([{"id": "a"}, {"id": "b"}], 1).load_state_dict(
            {"epoch": 0, "cursor": 5, "seed": 0}
        )
