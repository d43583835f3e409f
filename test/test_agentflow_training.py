"""Training an AgentFlow + Evaluator under rLLM's trainer, its calls through rLLM's model gateway.

``learning_run`` (one per module): the digit task as ``examples/simple_math/flow.py`` through
``AgentTrainer(backend="skyrl", agent_flow=..., evaluator=...)``, from ``partly_taught_model`` like
the workflow curves, with groups of 16: a flow costs several times a workflow rollout on two cores
(rLLM's per-rollout session, flush and trace calls; bench/README.md: 'An AgentFlow step through
rLLM's model gateway'), so a step holds half the quickstart's rollouts. Several checks read the one
curve. The fully-async run trains the same flow through ``UnifiedTrainer(backend_cls=...)`` with
``hooks=``.
"""

from __future__ import annotations

import pytest
from rllm_harness import (
    DIGITS,
    RecordingBackend,
    digit_rows,
    last_mean,
    learning_digits,
    requires_rllm,
    rllm_config,
    syncs_by_hook,
)

from rllm_skyrl import rllm_plugin
from rllm_skyrl.run.metrics_file import read_metrics

pytestmark = [requires_rllm, pytest.mark.slow]

LEARNING = [
    "training.group_size=16",
    "data.train_batch_size=16",
    "rllm.trainer.test_freq=0",
    "rllm.trainer.val_before_train=false",
    "rllm.gateway.port=0",
    "rllm.workflow.n_parallel_tasks=64",  # see examples/simple_math/train_agentflow.sh
    "inference.max_batch_size=512",
]
GAP = "train/logprob_abs_diff/mean"  # trainer vs rollout logprobs, as for workflows
STEPS = 50


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory, partly_taught_model):
    from rllm.trainer import AgentTrainer

    from examples.simple_math.flow import digit_evaluator, digit_flow

    tmp_path = tmp_path_factory.mktemp("agentflow")
    cfg = rllm_config(
        tmp_path, *learning_digits(partly_taught_model), *LEARNING, f"rllm.trainer.total_batches={STEPS}"
    )
    rllm_plugin.register()
    RecordingBackend.instances.clear()
    try:
        AgentTrainer(
            config=cfg,
            backend="skyrl",
            agent_flow=digit_flow,
            evaluator=digit_evaluator,
            train_dataset=digit_rows(4096),
            backend_cls=RecordingBackend,
        ).train()
    finally:
        rllm_plugin.unregister()
    (backend,) = RecordingBackend.instances
    records = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    return backend, records


@pytest.mark.timeout(3600)
def test_an_agent_flow_learns_the_digit_task_through_the_gateway(learning_run):
    _, records = learning_run
    print("\nreward per step:", " ".join(f"{r['reward/mean']:.2f}" for r in records))
    assert len(records) == STEPS
    assert last_mean(records[:10], "reward/mean") <= 0.3
    assert last_mean(records, "reward/mean") >= 0.8


def test_trained_logprobs_are_the_ones_the_servers_sampled(learning_run):
    """The gap between the trainer's and the rollout's logprobs stays at the workflow path's fp32 CPU
    figure (~1e-7): the traces carry the servers' own token ids and logprobs."""
    _, records = learning_run
    gaps = [r[GAP] for r in records]
    assert len(gaps) == len(records) and max(gaps) < 1e-5


def test_every_step_syncs_once_and_its_rollouts_carry_the_version(learning_run):
    backend, records = learning_run
    assert syncs_by_hook(backend) == {"on_batch_end": list(range(1, len(records) + 1))}
    assert backend.rollout_engine.gateway is not None
    assert all(r["batch/steps_without_tokens"] == 0 for r in records)
    assert all(r["batch/dropped_malformed_sequences"] == 0 for r in records)


@pytest.mark.timeout(1800)
def test_fully_async_trains_an_agent_flow_with_one_sync_per_version(tmp_path):
    from rllm.hooks import FixedEvaluatorHooks
    from rllm.trainer.unified_trainer import UnifiedTrainer

    from examples.simple_math.flow import digit_evaluator, digit_flow

    cfg = rllm_config(
        tmp_path,
        *DIGITS,
        "training.group_size=4",
        "rllm.gateway.port=0",
        "rllm.async_training.enable=true",
        "rllm.async_training.mini_batch_size=8",
        "rllm.async_training.fwd_bwd_group_size=2",
        "rllm.async_training.staleness_threshold=1.0",
        "rllm.workflow.raise_on_error=false",
        "rllm.trainer.total_batches=4",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.val_before_train=false",
    )
    RecordingBackend.instances.clear()
    trainer = UnifiedTrainer(
        backend_cls=RecordingBackend,
        config=cfg,
        train_dataset=digit_rows(64),
        agent_flow=digit_flow,
        hooks=FixedEvaluatorHooks(digit_evaluator),
    )
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    (backend,) = RecordingBackend.instances
    updates = [shape["weight_version"] for name, shape in backend.calls if name == "on_policy_updated"]
    assert updates == [1, 2, 3]  # rLLM's async loop stops one step before total_batches
    assert syncs_by_hook(backend) == {"on_policy_updated": updates}
    assert backend.rollout_engine.weight_version == 3 and backend.rollout_engine.gateway is not None
