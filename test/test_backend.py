"""SkyRLBackend end to end on CPU: config checks and the masks that reach SkyRL.

The options that shape an update (mini-batches, epochs, KL, old logprobs, filtering) are covered
in ``test_update_paths.py``; GRPO learning the digit task under rLLM's trainer in
``test_rllm_conformance.py``, and the quickstart's learning curve in ``test_compat.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import compose_run, compose_unified, run_dirs
from omegaconf import OmegaConf

from examples.simple_math.task import make_rows, reward_fn
from rllm_skyrl.backend import SkyRLBackend
from rllm_skyrl.rllm_names import Episode, Step, Trajectory, Workflow
from rllm_skyrl.run_config import with_aliases
from rllm_skyrl.training_run import train
from rllm_skyrl.update.workers import SkyRLWorkers


def unified_config(tmp_path, *overrides: str):
    return compose_unified(*run_dirs(tmp_path), *overrides)


# --------------------------------------------------------------------------- no Ray


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rllm.algorithm.adv_estimator=vtrace", "rllm.algorithm.adv_estimator"),
        ("rllm.algorithm.loss_fn=ppo_critic", "ppo_critic"),
        ("rllm.algorithm.loss_agg_mode=token-max", "rllm.algorithm.loss_agg_mode"),
        ("training.resume_mode=sometimes", "training.resume_mode"),
        ("training.resume_mode=resume_path", "training.resume_from_path"),
        ("training.group_size=1", "rllm.rollout.n >= 2"),
        ("+skyrl.trainer.not_a_key=1", "not_a_key"),
        ("rllm.algorithm.router_replay=R2", "rllm.algorithm.router_replay"),
        ("training.num_minibatches=3", "training.num_minibatches"),
    ],
)
def test_validate_config_names_the_offending_key(tmp_path, override, message):
    backend = SkyRLBackend(unified_config(tmp_path, override))
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("+", r"\+")):
        backend.validate_config()


def test_validate_config_requires_a_model(tmp_path):
    cfg = compose_unified(model=None)
    with pytest.raises(ValueError, match="model.path"):
        SkyRLBackend(cfg).validate_config()


def test_validate_config_copies_aliases_onto_the_rllm_keys_the_trainer_reads(tmp_path):
    """``UnifiedTrainer(backend_cls=SkyRLBackend, config=cfg)`` with tinker's ``data.train_batch_size``:
    the trainer's data loaders read ``rllm.data.train_batch_size``, so that key (and only such rllm.*
    keys) is written; a config from ``with_aliases`` has nothing left to write."""
    cfg = unified_config(tmp_path, "data.train_batch_size=8", "training.max_length=96")
    expected = OmegaConf.to_container(cfg)
    expected["rllm"]["data"]["train_batch_size"] = 8  # inference.max_model_len is ours: untouched
    SkyRLBackend(cfg).validate_config()
    assert OmegaConf.to_container(cfg) == expected
    aliased = with_aliases(unified_config(tmp_path, "data.train_batch_size=8"))
    given = OmegaConf.to_container(aliased)
    SkyRLBackend(aliased).validate_config()
    assert OmegaConf.to_container(aliased) == given


def test_validate_config_starts_nothing(tmp_path):
    import ray

    ray_was_running = ray.is_initialized()
    backend = SkyRLBackend(unified_config(tmp_path))
    backend.validate_config()
    assert backend.run.skyrl.generator.n_samples_per_prompt == 8
    assert backend.run.skyrl.trainer.algorithm.temperature == 1.0
    assert backend.runtime is None
    assert ray.is_initialized() == ray_was_running


# --------------------------------------------------------------------------- through Ray


@pytest.fixture
def recorded_batches(monkeypatch):
    """Every batch the backend hands to SkyRL's forward_backward, with the role it went to."""
    calls: list[tuple[str, object]] = []
    original = SkyRLWorkers.forward_backward

    def recording(self, role, batch, *args, **kwargs):
        calls.append((role, batch))
        return original(self, role, batch, *args, **kwargs)

    monkeypatch.setattr(SkyRLWorkers, "forward_backward", recording)
    return calls


@pytest.fixture
def recorded_groups(monkeypatch):
    groups: list[list] = []
    original = SkyRLBackend.transform_to_backend_batch

    def recording(self, trainer_state, **kwargs):
        groups.append(list(trainer_state.trajectory_groups))
        return original(self, trainer_state, **kwargs)

    monkeypatch.setattr(SkyRLBackend, "transform_to_backend_batch", recording)
    return groups


class TwoTurnTokenWorkflow(Workflow):
    """Two model turns in one token stream: turn 2's prompt is turn 1's prompt + response + feedback.

    Built at the token level (token in, token out), so turn 2 extends turn 1 exactly whatever the
    model said, which is what lets the backend merge both turns into one training row.
    """

    async def run(self, task, uid, **kwargs):
        engine = self.rollout_engine
        first = await engine.get_model_response([{"role": "user", "content": task["question"]}])
        feedback = engine.tokenizer(
            "<|im_end|>\n<|im_start|>user\ntry once more<|im_end|>\n<|im_start|>assistant\n"
        )
        prompt = [*first.prompt_ids, *first.completion_ids, *feedback["input_ids"]]
        second = engine.assemble_model_output(prompt, await engine.get_token_output_from_token_input(prompt))
        steps = [Step(model_output=first, reward=0.0), Step(model_output=second, reward=0.0, done=True)]
        reward = reward_fn(task, second.content or "")
        return Episode(
            id=uid, task=task, trajectories=[Trajectory(name="agent", task=task, steps=steps, reward=reward)]
        )


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_two_turn_masks_reach_skyrl(tmp_path, recorded_batches, recorded_groups):
    """Turn 2's prompt extends turn 1: one row per trajectory, loss only on the model's tokens."""
    cfg = compose_run(
        *run_dirs(tmp_path),
        "rllm.data.train_batch_size=2",
        "training.group_size=2",
        "rllm.data.max_response_length=3",
        "rllm.data.max_prompt_length=96",
        "rllm.trainer.total_batches=2",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.save_freq=0",
    )
    train(
        cfg,
        workflow_class=TwoTurnTokenWorkflow,
        workflow_args={},
        train_dataset=make_rows(8),
    )
    assert len(recorded_batches) == 2 and len(recorded_groups) == 2
    for (role, batch), groups in zip(recorded_batches, recorded_groups, strict=True):
        assert role == "policy"
        trajectories = [t for g in groups for t in g.trajectories]
        assert len(trajectories) == 4
        width = batch["loss_mask"].shape[1]
        for row, trajectory in enumerate(trajectories):
            first, second = trajectory.steps
            history = list(first.prompt_ids) + list(first.response_ids)
            assert list(second.prompt_ids[: len(history)]) == history, "turn 2 must extend turn 1"
            observation = list(second.prompt_ids[len(history) :])
            assert observation, "the feedback message must add tokens"
            expected_mask = (
                [1] * len(first.response_ids) + [0] * len(observation) + [1] * len(second.response_ids)
            )
            expected_lp = list(first.logprobs) + [0.0] * len(observation) + list(second.logprobs)
            n = len(expected_mask)
            full = list(first.prompt_ids) + list(first.response_ids) + observation + list(second.response_ids)
            assert batch["sequences"][row, -len(full) :].tolist() == full
            assert (batch["loss_mask"][row, -n:] > 0).int().tolist() == expected_mask
            assert batch["loss_mask"][row, : width - n].abs().sum() == 0
            torch.testing.assert_close(
                batch["rollout_logprobs"][row, -n:], torch.tensor(expected_lp), atol=1e-6, rtol=0
            )
            observation_advantages = batch["advantages"][row, -n:][torch.tensor(expected_mask) == 0]
            assert observation_advantages.abs().sum() == 0, "observation tokens must carry no advantage"
