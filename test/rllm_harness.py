"""Driving the backend with the real rLLM: its config, its trainer, its workflows (test helpers).

Imported only by tests that need rLLM; they skip when rLLM is absent, and a CI run fails then
(``conftest.ALLOWED_SKIPS_IN_CI``).
"""

from __future__ import annotations

import importlib.util
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from helpers import partly_taught
from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from examples.simple_math.task import digit_reward, make_rows  # noqa: F401 (the tests take it from here)
from rllm_skyrl.backend import SkyRLBackend

RLLM_MISSING = "rLLM is not installed (scripts/test.sh installs the vendored snapshot)"
requires_rllm = pytest.mark.skipif(importlib.util.find_spec("rllm") is None, reason=RLLM_MISSING)

# The quickstart's workload, under rLLM's key names (see examples/simple_math/train_with_rllm.sh).
DIGITS = [
    "model.name=tiny",
    "training.learning_rate=1e-3",
    "data.max_prompt_length=64",
    "data.max_response_length=2",
    "rllm.trainer.save_freq=-1",
    "rllm.trainer.logger=[console]",
    "skyrl.trainer.micro_train_batch_size_per_gpu=512",
    "skyrl.trainer.micro_forward_batch_size_per_gpu=512",
]


def learning_digits(start_model: str) -> list[str]:
    """``DIGITS`` for a learning curve, from ``conftest.partly_taught_model`` (``helpers.partly_taught``)."""
    return [*DIGITS, *partly_taught(start_model, model_key="model.name")]


def rllm_config(tmp_path: Path, *overrides: str) -> DictConfig:
    """rLLM's packaged ``unified`` config with ``rllm/backend=skyrl``, run files under ``tmp_path``."""
    with initialize_config_module("rllm.trainer.config", version_base=None):
        return compose(
            "unified",
            overrides=[
                "rllm/backend=skyrl",
                f"training.default_local_dir={tmp_path}/ckpt",
                f"rllm.trainer.run_dir={tmp_path}/run",
                *overrides,
            ],
        )


def digit_rows(count: int, seed: int = 0) -> list[dict]:
    return make_rows(count, seed=seed)


def last_mean(records: list[dict], key: str, window: int = 10) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    assert values, f"no {key} in {len(records)} records"
    tail = values[-window:]
    return sum(tail) / len(tail)


class RecordingBackend(SkyRLBackend):
    """The real backend, recording its hook calls (name, argument shapes, times) and weight syncs."""

    instances: list[RecordingBackend] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        RecordingBackend.instances.append(self)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.syncs: list[tuple[str, int]] = []  # (hook that synced, version)
        self.process_windows: list[tuple[float, float]] = []
        self._hook = ""

    def _record(self, name: str, **shape: Any) -> None:
        self.calls.append((name, shape))

    def validate_config(self):
        self._record("validate_config")
        return super().validate_config()

    def init_rollout_engine(self, **kwargs):
        self._record("init_rollout_engine", keys=tuple(sorted(kwargs)))
        engine = super().init_rollout_engine(**kwargs)
        finished: list[float] = []
        original = engine.get_token_output_from_token_input

        async def timed(*args: Any, **kw: Any):
            output = await original(*args, **kw)
            finished.append(time.perf_counter())
            return output

        engine.get_token_output_from_token_input = timed
        self.request_finish_times = finished
        sync = self.runtime.sync_weights

        async def counted(version: int) -> int | None:
            self.syncs.append((self._hook, version))
            return await sync(version)

        self.runtime.sync_weights = counted
        return engine

    async def generate_episodes(self, batch, agent_workflow_engine, is_validation=False, **kwargs):
        self._record("generate_episodes", rows=len(batch), is_validation=is_validation)
        return await super().generate_episodes(batch, agent_workflow_engine, is_validation, **kwargs)

    def transform_to_backend_batch(self, trainer_state, **kwargs):
        self._record("transform_to_backend_batch", groups=len(trainer_state.trajectory_groups))
        return super().transform_to_backend_batch(trainer_state, **kwargs)

    async def process_backend_batch(self, trainer_state, **kwargs):
        self._record("process_backend_batch")
        start = time.perf_counter()
        await super().process_backend_batch(trainer_state, **kwargs)
        self.process_windows.append((start, time.perf_counter()))

    async def compute_advantages(self, trainer_state, algorithm_config=None, **kwargs):
        self._record("compute_advantages", algorithm_config=type(algorithm_config).__name__)
        await super().compute_advantages(trainer_state, algorithm_config, **kwargs)

    async def update_policy(self, trainer_state, **kwargs):
        self._record("update_policy")
        await super().update_policy(trainer_state, **kwargs)

    async def on_policy_updated(self, trainer_state):
        self._record("on_policy_updated", weight_version=trainer_state.weight_version)
        self._hook = "on_policy_updated"
        await super().on_policy_updated(trainer_state)

    async def on_batch_end(self, trainer_state):
        self._record("on_batch_end", step=trainer_state.global_step)
        self._hook = "on_batch_end"
        await super().on_batch_end(trainer_state)


def _hook_recorder(name: str):
    async def hook(self, trainer_state, *args: Any, **kwargs: Any):
        self._record(name, step=getattr(trainer_state, "global_step", None))
        return await getattr(SkyRLBackend, name)(self, trainer_state, *args, **kwargs)

    return hook


for _name in (
    "on_train_start",
    "on_train_end",
    "on_epoch_start",
    "on_epoch_end",
    "on_batch_start",
    "on_validation_start",
    "on_validation_end",
):
    setattr(RecordingBackend, _name, _hook_recorder(_name))


def run_rllm(
    cfg: DictConfig, workflow_class: type, workflow_args: dict, train: Any, val: Any = None, **kwargs: Any
):
    """Train under rLLM's UnifiedTrainer through this package's launcher class (the run every entry
    gets: metrics.jsonl, the plot and the summary); returns the recording backend of the run."""
    from rllm_skyrl.rllm_plugin import SkyRLTrainerLauncher

    RecordingBackend.instances.clear()
    SkyRLTrainerLauncher(
        cfg,
        workflow_class=workflow_class,
        workflow_args=workflow_args,
        train_dataset=train,
        val_dataset=val,
        backend_cls=RecordingBackend,
        **kwargs,
    ).train()
    (backend,) = RecordingBackend.instances
    return backend


def digit_run(tmp_path: Path, *overrides: str, reward=digit_reward) -> list[dict]:
    """rLLM's ``SimpleWorkflow`` on the digit prompts under rLLM's trainer and config, no validation:
    the step records of ``metrics.jsonl``."""
    from rllm.workflows.simple_workflow import SimpleWorkflow

    from rllm_skyrl.run.metrics_file import read_metrics

    cfg = rllm_config(tmp_path, *DIGITS, "rllm.trainer.test_freq=0", *overrides)
    run_rllm(cfg, SimpleWorkflow, {"reward_function": reward}, digit_rows(4096))
    return [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]


def requests_during(backend: RecordingBackend) -> int:
    """Requests that finished while a forward-backward ran (rollouts kept going during training)."""
    return sum(
        any(start <= t <= end for start, end in backend.process_windows) for t in backend.request_finish_times
    )


def syncs_by_hook(backend: RecordingBackend) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for hook, version in backend.syncs:
        out[hook].append(version)
    return dict(out)
