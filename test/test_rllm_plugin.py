"""The rLLM plug-in: dispatch, launcher, hook contract and Hydra search path.

Most tests run against a small stand-in ``rllm`` package written to a temporary directory: it has
rLLM's import paths (``rllm.trainer.unified_trainer``), ``AgentTrainer``'s if/elif backend
dispatch and ``UnifiedTrainer``'s constructor and on-policy call order, and nothing else. Tests
marked ``real_rllm`` use the real rLLM when it is installed and skip otherwise.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from rllm_skyrl import rllm_plugin
from rllm_skyrl.rllm_plugin import SkyRLTrainerLauncher

REPO = Path(__file__).resolve().parent.parent
REAL_RLLM = importlib.util.find_spec("rllm") is not None
real_rllm = pytest.mark.skipif(
    not REAL_RLLM,
    reason="rLLM is not installed (it is not on PyPI; `pip install -e <rLLM checkout>` to run these)",
)

STAND_IN_UNIFIED_TRAINER = '''
"""Stand-in for rllm.trainer.unified_trainer: constructor and on-policy call order of the real one."""
import asyncio
from dataclasses import dataclass, field
from typing import Any

TRAINERS = []


@dataclass
class TrainerState:
    global_step: int = 0
    epoch: int = 0
    is_training: bool = True
    metrics: dict = field(default_factory=dict)
    episodes: Any = None
    trajectory_groups: Any = None
    backend_batch: Any = None

    def reset_batch(self):
        self.metrics, self.episodes, self.trajectory_groups, self.backend_batch = {}, None, None, None


class WorkflowEngine:
    async def execute_tasks(self, tasks, task_ids=None, is_validation=False, **kwargs):
        return []


class UnifiedTrainer:
    def __init__(self, backend_cls, config, workflow_class=None, train_dataset=None, val_dataset=None,
                 workflow_args=None, backend_args=None, *, traj_grouping_hook=None,
                 traj_group_adv_estimator_map=None, store=None, **kwargs):
        TRAINERS.append(self)
        self.config, self.workflow_class, self.workflow_args = config, workflow_class, workflow_args
        self.train_dataset, self.store, self.kwargs = train_dataset, store, kwargs
        self.backend = backend_cls(config=config, **(backend_args or {}))
        self.backend.validate_config()
        self.algorithm_config = object()
        self.backend.init_rollout_engine(cf_config=None, transform_config=None, rs_config=None,
                                         algorithm_config=self.algorithm_config,
                                         total_training_steps=len(train_dataset))
        self.agent_workflow_engine = WorkflowEngine()
        self.tokenizer = getattr(self.backend, "tokenizer", None)

    def fit(self):
        asyncio.run(self.fit_async())

    async def fit_async(self):
        state = TrainerState()
        await self.backend.on_train_start(state)
        try:
            state.global_step += 1
            await self.backend.on_epoch_start(state)
            for batch in self.train_dataset:
                state.reset_batch()
                await self.backend.on_batch_start(state)
                try:
                    state.episodes = await self.backend.generate_episodes(
                        batch, agent_workflow_engine=self.agent_workflow_engine, is_validation=False)
                    state.trajectory_groups = []
                    state.backend_batch = self.backend.transform_to_backend_batch(state)
                    await self.backend.process_backend_batch(state)
                    await self.backend.compute_advantages(state, self.algorithm_config)
                    await self.backend.update_policy(state)
                finally:
                    await self.backend.on_batch_end(state)
                state.global_step += 1
            await self.backend.on_epoch_end(state)
        finally:
            await self.backend.on_train_end(state)

    def shutdown(self):
        self.backend.shutdown()


class StandInLauncher:
    def __init__(self, backend, **kwargs):
        self.backend = backend


class AgentTrainer:
    def __init__(self, config, workflow_class=None, train_dataset=None, val_dataset=None, workflow_args=None,
                 backend="verl", agent_flow=None, evaluator=None, hooks=None, sandbox_backend=None,
                 sandbox_concurrency=None, store=None, **kwargs):
        kwargs["backend_name"] = backend
        if backend == "verl":
            self.launcher = StandInLauncher("verl", config=config, **kwargs)
        elif backend == "tinker":
            self.launcher = StandInLauncher("tinker", config=config, **kwargs)
        else:
            raise ValueError(f"Unsupported backend: {backend}")

    def train(self):
        self.launcher.train()
'''

# What rLLM's UnifiedTrainer passes to each backend method, and whether it awaits the result.
RLLM_CALLS: dict[str, tuple[tuple, dict, bool]] = {
    "validate_config": ((), {}, False),
    "init_rollout_engine": (
        (),
        dict(cf_config=1, transform_config=1, rs_config=1, algorithm_config=1, total_training_steps=3),
        False,
    ),
    "generate_episodes": (([{}],), dict(agent_workflow_engine=1, is_validation=False), True),
    "transform_to_backend_batch": (("state",), {}, False),
    "process_backend_batch": (("state",), {}, True),
    "compute_advantages": (("state", "algorithm_config"), {}, True),
    "update_policy": (("state",), {}, True),
    **{
        hook: (("state",), {}, True)
        for hook in (
            "on_train_start",
            "on_train_end",
            "on_epoch_start",
            "on_epoch_end",
            "on_batch_start",
            "on_batch_end",
            "on_policy_updated",
            "on_validation_start",
            "on_validation_end",
        )
    },
    "shutdown": ((), {}, False),
}

ON_POLICY_STEP = [
    "on_batch_start",
    "generate_episodes",
    "transform_to_backend_batch",
    "process_backend_batch",
    "compute_advantages",
    "update_policy",
    "on_batch_end",
]


class RecordingBackend:
    """Records each call rLLM's trainer makes; ``fail_in`` makes one stage raise."""

    fail_in: str | None = None

    def __init__(self, config: Any, **kwargs: Any) -> None:
        self.config, self.kwargs, self.calls = config, kwargs, []
        self.rollout_engine = self.tokenizer = None
        type(self).last = self

    def __getattr__(self, name: str):
        if name not in RLLM_CALLS:
            raise AttributeError(name)

        def record(*args: Any, **kwargs: Any):
            self.calls.append(name)
            if name == self.fail_in:
                raise RuntimeError(f"{name} failed")

        async def record_async(*args: Any, **kwargs: Any):
            record(*args, **kwargs)

        return record_async if RLLM_CALLS[name][2] else record


class FailingUpdateBackend(RecordingBackend):
    fail_in = "update_policy"


class Workflow:
    """A workflow class as AgentTrainer receives it; never instantiated by these tests."""


@pytest.fixture
def stand_in_rllm(tmp_path, monkeypatch):
    """The stand-in ``rllm`` package first on ``sys.path``; any real rLLM modules are restored afterwards."""
    root = tmp_path / "stand_in"
    (root / "rllm" / "trainer").mkdir(parents=True)
    (root / "rllm" / "__init__.py").write_text("")
    (root / "rllm" / "trainer" / "__init__.py").write_text("from .unified_trainer import AgentTrainer\n")
    (root / "rllm" / "trainer" / "unified_trainer.py").write_text(STAND_IN_UNIFIED_TRAINER)
    for name in [m for m in sys.modules if m == "rllm" or m.startswith("rllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))
    yield root
    rllm_plugin.unregister()
    for name in [m for m in sys.modules if m == "rllm" or m.startswith("rllm.")]:
        del sys.modules[name]


def _config(**rllm: Any):
    return OmegaConf.create({"rllm": {"remote_runtime": {"enabled": False}, **rllm}})


def _run_python(script: str, extra_path: list[Path] = ()) -> dict:
    """Run ``script`` in a fresh interpreter (Hydra discovers plug-ins once per process); return its JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), str(REPO), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# --- dispatch and launcher (stand-in rLLM) ------------------------------------------------------


def test_importing_the_plugin_does_not_import_rllm(stand_in_rllm):
    found = _run_python(
        """
        import json, sys
        import rllm_skyrl.rllm_plugin
        print(json.dumps(sorted(m for m in sys.modules if m == "rllm" or m.startswith("rllm."))))
        """,
        extra_path=[stand_in_rllm],
    )
    assert found == []


def test_agent_trainer_skyrl_runs_rllm_trainer_with_our_launcher(stand_in_rllm):
    rllm_plugin.register()
    from rllm.trainer import AgentTrainer, unified_trainer

    cfg = _config()
    rows = [[{"id": "a"}], [{"id": "b"}]]
    trainer = AgentTrainer(
        config=cfg,
        workflow_class=Workflow,
        workflow_args={"k": 1},
        train_dataset=rows,
        backend="skyrl",
        store="store",
        backend_cls=RecordingBackend,
        backend_args={"extra": 1},
    )
    assert isinstance(trainer.launcher, SkyRLTrainerLauncher)
    trainer.train()

    backend = RecordingBackend.last
    setup = ["validate_config", "init_rollout_engine", "on_train_start", "on_epoch_start"]
    teardown = ["on_epoch_end", "on_train_end", "shutdown"]
    assert backend.calls == setup + ON_POLICY_STEP * len(rows) + teardown
    assert backend.config is cfg and backend.kwargs == {"cli_overrides": [], "extra": 1}
    rllm_trainer = unified_trainer.TRAINERS[-1]
    assert rllm_trainer.workflow_class is Workflow and rllm_trainer.workflow_args == {"k": 1}
    assert rllm_trainer.store == "store" and rllm_trainer.kwargs == {"backend_name": "skyrl"}


def test_shutdown_runs_when_a_training_stage_fails(stand_in_rllm):
    launcher = SkyRLTrainerLauncher(
        _config(), workflow_class=Workflow, train_dataset=[[{}]], backend_cls=FailingUpdateBackend
    )
    with pytest.raises(RuntimeError, match="update_policy failed"):
        launcher.train()
    assert FailingUpdateBackend.last.calls[-4:] == [
        "update_policy",
        "on_batch_end",
        "on_train_end",
        "shutdown",
    ]


def test_other_backends_keep_rllms_own_dispatch(stand_in_rllm):
    rllm_plugin.register()
    from rllm.trainer.unified_trainer import AgentTrainer

    assert AgentTrainer(_config(), workflow_class=Workflow).launcher.backend == "verl"
    assert AgentTrainer(_config(), Workflow, backend="tinker").launcher.backend == "tinker"
    with pytest.raises(ValueError, match="Unsupported backend: nope"):
        AgentTrainer(_config(), workflow_class=Workflow, backend="nope")


def test_register_is_idempotent_and_unregister_restores(stand_in_rllm):
    from rllm.trainer.unified_trainer import AgentTrainer

    original = AgentTrainer.__init__
    rllm_plugin.register()
    patched = AgentTrainer.__init__
    rllm_plugin.register()
    assert AgentTrainer.__init__ is patched is not original
    assert inspect.signature(patched) == inspect.signature(original)
    rllm_plugin.unregister()
    assert AgentTrainer.__init__ is original
    with pytest.raises(ValueError, match="Unsupported backend: skyrl"):
        AgentTrainer(_config(), workflow_class=Workflow, backend="skyrl")


@pytest.mark.parametrize(
    ("arguments", "config", "named"),
    [
        ({"agent_flow": object(), "evaluator": object()}, _config(), "agent_flow, evaluator"),
        ({"agent_flow": object(), "hooks": object()}, _config(), "agent_flow, hooks"),
        ({}, _config(remote_runtime={"enabled": True}), "rllm.remote_runtime.enabled"),
    ],
)
def test_gateway_paths_are_refused_with_the_reason(stand_in_rllm, arguments, config, named):
    rllm_plugin.register()
    from rllm.trainer.unified_trainer import AgentTrainer

    with pytest.raises(NotImplementedError, match="model gateway") as caught:
        AgentTrainer(config, workflow_class=Workflow, backend="skyrl", **arguments)
    assert named in str(caught.value)


def test_skyrl_without_workflow_class_says_so(stand_in_rllm):
    rllm_plugin.register()
    from rllm.trainer.unified_trainer import AgentTrainer

    with pytest.raises(ValueError, match="needs workflow_class"):
        AgentTrainer(_config(), backend="skyrl")


# --- the backend's side of the contract -----------------------------------------------------------


@pytest.mark.parametrize("method", sorted(RLLM_CALLS))
def test_skyrl_backend_accepts_each_call_rllm_makes(method):
    """Every hook takes rLLM's arguments (positional and keyword as rLLM passes them) and is
    awaitable exactly where rLLM awaits it."""
    from rllm_skyrl.backend import SkyRLBackend

    args, kwargs, awaited = RLLM_CALLS[method]
    function = getattr(SkyRLBackend, method)
    inspect.signature(function).bind(object(), *args, **kwargs)
    assert inspect.iscoroutinefunction(function) is awaited


def test_skyrl_backend_constructs_and_validates_as_rllm_does():
    """rLLM's trainer: ``backend_cls(config=config, **backend_args)``, then ``validate_config()``."""
    from hydra import compose, initialize_config_module

    from rllm_skyrl.backend import SkyRLBackend

    with initialize_config_module("rllm_skyrl.config", version_base=None):
        cfg = compose("unified", overrides=["model.path=tiny"])
    backend = SkyRLBackend(config=cfg, **{"cli_overrides": ["model.path=tiny"]})
    backend.validate_config()
    assert backend.rollout_engine is None and backend.tokenizer is None  # set by init_rollout_engine
    assert Path(backend.run.skyrl.trainer.policy.model.path).is_dir()  # `tiny` resolved to its directory


# --- Hydra search path ------------------------------------------------------------------------------

STAND_IN_RLLM_CONFIG = {
    "unified.yaml": "defaults:\n  - rllm: base\n  - rllm/backend: verl\n  - _self_\n",
    "rllm/base.yaml": "marker: stand_in_rllm_base\ntrainer: {project_name: p, experiment_name: e}\n",
    "rllm/backend/verl.yaml": "# @package _global_\nverl_only: true\n",
}


def test_search_path_plugin_resolves_skyrl_backend_and_shadows_nothing(tmp_path):
    for name, text in STAND_IN_RLLM_CONFIG.items():
        (tmp_path / "rllm_config" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "rllm_config" / name).write_text(text)
    (tmp_path / "own_backend" / "rllm" / "backend").mkdir(parents=True)
    (tmp_path / "own_backend" / "rllm" / "backend" / "skyrl.yaml").write_text("# @package _global_\nown: 1\n")
    (tmp_path / "empty").mkdir()
    result = _run_python(
        f"""
        import json
        from hydra import compose, initialize_config_dir
        from hydra.errors import HydraException
        from omegaconf import OmegaConf

        def attempt(config_dir, name, overrides=()):
            with initialize_config_dir(config_dir=config_dir, version_base=None):
                try:
                    return OmegaConf.to_container(compose(name, overrides=list(overrides)), resolve=True)
                except HydraException as error:
                    return str(error)

        root = {str(tmp_path)!r}
        print(json.dumps({{
            "skyrl": attempt(root + "/rllm_config", "unified", ["rllm/backend=skyrl", "model.path=tiny"]),
            "default": attempt(root + "/rllm_config", "unified"),
            "unknown": attempt(root + "/rllm_config", "unified", ["rllm/backend=nope"]),
            "our_unified": attempt(root + "/empty", "unified"),
            "our_base": attempt(root + "/empty", "rllm/base"),
            "own_file_wins": attempt(root + "/own_backend", "rllm/backend/skyrl"),
        }}))
        """
    )
    skyrl = result["skyrl"]
    assert skyrl["rllm"]["marker"] == "stand_in_rllm_base"  # the app's rllm/base, not ours
    assert skyrl["rllm"]["rollout"]["n"] == skyrl["training"]["group_size"]
    assert skyrl["skyrl"]["trainer"]["policy"]["model"]["path"] == "tiny"
    assert "verl_only" not in skyrl
    assert result["default"]["verl_only"] is True and "skyrl" not in result["default"]
    assert "skyrl" in result["unknown"] and "verl" in result["unknown"]  # Hydra lists both options
    assert "Cannot find primary config 'unified'" in result["our_unified"]
    assert "Cannot find primary config 'rllm/base'" in result["our_base"]
    assert result["own_file_wins"] == {"own": 1}


# --- the real rLLM ------------------------------------------------------------------------------------


@real_rllm
def test_real_rllm_unified_config_composes_with_skyrl_backend():
    result = _run_python(
        """
        import json
        from hydra import compose, initialize_config_module
        from omegaconf import OmegaConf
        from rllm_skyrl.run_config import BRIDGE, skyrl_overrides
        from rllm_skyrl.run_config import make_skyrl_config

        with initialize_config_module("rllm.trainer.config", version_base=None):
            overrides = ["rllm/backend=skyrl", "model.path=tiny", "training.group_size=4"]
            cfg = compose("unified", overrides=overrides)
        skyrl_cfg = make_skyrl_config(skyrl_overrides(cfg))
        missing = [p.rllm for p in BRIDGE if OmegaConf.select(cfg, p.rllm, default=KeyError) is KeyError]
        print(json.dumps({
            "top": sorted(cfg.keys()),
            "n": cfg.rllm.rollout.n,
            "bypass_mode": cfg.rllm.algorithm.rollout_correction.bypass_mode,
            "remote_runtime": OmegaConf.select(cfg, "rllm.remote_runtime.enabled"),
            "has_gateway": "gateway" in cfg.rllm,
            "missing_bridged_keys": missing,
            "skyrl_n": skyrl_cfg.generator.n_samples_per_prompt,
            "skyrl_batch": skyrl_cfg.trainer.train_batch_size,
            "rllm_batch": cfg.rllm.data.train_batch_size,
            "policy_path": skyrl_cfg.trainer.policy.model.path,
        }))
        """
    )
    assert {"model", "rllm", "skyrl", "training", "inference"} <= set(result["top"])
    assert result["has_gateway"]  # rLLM's own rllm/base, not our stand-in
    assert result["missing_bridged_keys"] == []  # every bridged rLLM key exists in rLLM's base config
    assert result["n"] == result["skyrl_n"] == 4
    assert result["skyrl_batch"] == result["rllm_batch"]
    assert result["bypass_mode"] is True and result["remote_runtime"] is False
    assert result["policy_path"] == "tiny"


@real_rllm
def test_real_rllm_backend_protocol_matches_skyrl_backend():
    from rllm.trainer.backend_protocol import BackendProtocol

    from rllm_skyrl.backend import SkyRLBackend

    for name, member in inspect.getmembers(BackendProtocol, inspect.isfunction):
        if name.startswith("_"):
            continue
        ours = getattr(SkyRLBackend, name, None)
        assert ours is not None, f"SkyRLBackend lacks {name}"
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(member), name
    assert set(RLLM_CALLS) <= {n for n, _ in inspect.getmembers(BackendProtocol, inspect.isfunction)}


@real_rllm
def test_real_rllm_agent_trainer_dispatches_skyrl():
    from rllm.trainer import AgentTrainer

    rllm_plugin.register()
    try:
        trainer = AgentTrainer(config=_config(), workflow_class=Workflow, backend="skyrl")
        assert isinstance(trainer.launcher, SkyRLTrainerLauncher)
    finally:
        rllm_plugin.unregister()
