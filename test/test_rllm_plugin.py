"""Being selected inside the real rLLM: AgentTrainer dispatch, the launcher, the Hydra plug-in.

Training under rLLM's trainer is in ``test_rllm_conformance.py``; this file covers how a user gets
there (``AgentTrainer(backend="skyrl")``, ``rllm/backend=skyrl``) and what happens when that fails.
"""

from __future__ import annotations

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
from rllm_harness import DIGITS, digit_reward, digit_rows, requires_rllm, rllm_config

from rllm_skyrl import rllm_plugin
from rllm_skyrl.backend import SkyRLBackend
from rllm_skyrl.rllm_plugin import SkyRLTrainerLauncher

pytestmark = requires_rllm
REPO = Path(__file__).resolve().parent.parent


def _config(**rllm: Any):
    return OmegaConf.create({"rllm": {"remote_runtime": {"enabled": False}, **rllm}})


def _run_python(script: str, cwd: Path = REPO, args: list[str] = ()) -> dict:
    """Run ``script`` in a fresh interpreter (Hydra discovers plug-ins once per process); return its JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def registered():
    rllm_plugin.register()
    yield
    rllm_plugin.unregister()


def _simple_workflow():
    from rllm.workflows.simple_workflow import SimpleWorkflow

    return SimpleWorkflow


# --- dispatch -------------------------------------------------------------------------------------------


def test_importing_the_plugin_does_not_import_rllm():
    found = _run_python(
        """
        import json, sys
        import rllm_skyrl.rllm_plugin
        print(json.dumps(sorted(m for m in sys.modules if m == "rllm" or m.startswith("rllm."))))
        """
    )
    assert found == []


def test_agent_trainer_skyrl_builds_our_launcher_with_rllms_arguments(registered):
    from rllm.trainer import AgentTrainer

    cfg = _config()
    trainer = AgentTrainer(
        config=cfg,
        workflow_class=_simple_workflow(),
        workflow_args={"reward_function": digit_reward},
        train_dataset=[{"id": "a"}],
        backend="skyrl",
        store="store",
        backend_args={"extra": 1},
        traj_group_adv_estimator_map={"solver": "rloo"},
    )
    launcher = trainer.launcher
    assert isinstance(launcher, SkyRLTrainerLauncher)
    assert launcher.config is cfg and launcher.workflow_args == {"reward_function": digit_reward}
    assert launcher.store == "store" and launcher.backend_args == {"extra": 1}
    assert launcher.kwargs == {"traj_group_adv_estimator_map": {"solver": "rloo"}, "backend_name": "skyrl"}


def test_other_backends_keep_rllms_own_dispatch(registered):
    from rllm.trainer import AgentTrainer

    with pytest.raises(ValueError, match="Unsupported backend: nope"):
        AgentTrainer(_config(), workflow_class=_simple_workflow(), backend="nope")


@pytest.mark.parametrize("backend", ["tinker", "verl", "fireworks", "nope"])
def test_every_other_backend_reaches_rllms_constructor_with_the_same_arguments(backend, monkeypatch):
    """The wrapper changes ``backend="skyrl"`` only: any other value (with a config not composed
    for skyrl) is passed to rLLM's own constructor as given, the same objects."""
    import functools

    from rllm.trainer.unified_trainer import AgentTrainer

    received = []

    @functools.wraps(AgentTrainer.__init__)  # the signature the wrapper binds against
    def rllms_init(self, *args, **kwargs):
        received.append((self, args, kwargs))

    monkeypatch.setattr(AgentTrainer, "__init__", rllms_init)
    rllm_plugin.register()
    try:
        assert AgentTrainer.__init__ is not rllms_init  # wrapped
        config, workflow, store = _config(backend="tinker"), _simple_workflow(), object()
        trainer = AgentTrainer(config, workflow_class=workflow, backend=backend, store=store)
    finally:
        rllm_plugin.unregister()
    passed = {"workflow_class": workflow, "backend": backend, "store": store}
    assert received == [(trainer, (config,), passed)]
    assert not hasattr(trainer, "launcher")


def test_with_the_set_turned_off_register_leaves_agent_trainer_as_rllm_wrote_it(monkeypatch):
    from rllm.trainer.unified_trainer import AgentTrainer

    original = AgentTrainer.__init__
    monkeypatch.setenv("RLLM_SKYRL_COMPAT_DISABLE", "rllm_agent_trainer")
    rllm_plugin.register()
    assert AgentTrainer.__init__ is original
    with pytest.raises(ValueError, match="Unsupported backend: skyrl"):
        AgentTrainer(_config(), workflow_class=_simple_workflow(), backend="skyrl")


def test_the_config_group_wins_over_a_backend_name_fixed_in_code(registered, caplog):
    """rLLM's countdown example hard-codes ``backend="tinker"``; its script picks the config group."""
    from rllm.trainer import AgentTrainer

    trainer = AgentTrainer(
        config=_config(backend="skyrl"), workflow_class=_simple_workflow(), train_dataset=[], backend="tinker"
    )
    assert isinstance(trainer.launcher, SkyRLTrainerLauncher)
    assert "AgentTrainer(backend='tinker')" in caplog.text


def test_register_is_idempotent_and_unregister_restores():
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
        AgentTrainer(_config(), workflow_class=_simple_workflow(), backend="skyrl")


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (_config(remote_runtime={"enabled": True, "backend": "harbor"}), "rllm.remote_runtime.enabled=true"),
        (_config(gateway={"tunnel": "cloudflared"}), "rllm.gateway.tunnel"),
        (_config(gateway={"tunnel": "https://gw.example.org"}), "rllm.gateway.tunnel"),
        (_config(gateway={"host": "0.0.0.0"}), "rllm.gateway.host=0.0.0.0"),
    ],
)
def test_gateway_settings_it_cannot_serve_are_refused_in_one_line(registered, config, named):
    """Before anything starts: the launcher, and the backend's validate_config (rLLM's UnifiedTrainer
    with backend_cls=SkyRLBackend calls it first), name the key and what to do."""
    from rllm.trainer import AgentTrainer

    from examples.simple_math.flow import digit_evaluator, digit_flow

    with pytest.raises(ValueError, match="backend=skyrl") as caught:
        AgentTrainer(config, backend="skyrl", agent_flow=digit_flow, evaluator=digit_evaluator)
    message = str(caught.value)
    assert named in message and "\n" not in message
    backend = SkyRLBackend(config)
    with pytest.raises(ValueError, match="backend=skyrl") as direct:
        backend.validate_config()
    assert named in str(direct.value)


@pytest.mark.parametrize("sandbox", [{"sandbox_backend": "docker"}, {"sandbox_concurrency": 4}])
def test_sandbox_arguments_are_refused(registered, sandbox):
    from rllm.trainer import AgentTrainer

    from examples.simple_math.flow import digit_evaluator, digit_flow

    with pytest.raises(NotImplementedError, match=next(iter(sandbox))):
        AgentTrainer(_config(), backend="skyrl", agent_flow=digit_flow, evaluator=digit_evaluator, **sandbox)


def test_an_agent_flow_without_evaluator_or_hooks_says_so(registered):
    from rllm.trainer import AgentTrainer

    from examples.simple_math.flow import digit_flow

    with pytest.raises(ValueError, match="evaluator="):
        AgentTrainer(_config(), backend="skyrl", agent_flow=digit_flow)


def test_skyrl_without_workflow_class_says_so(registered):
    from rllm.trainer import AgentTrainer

    with pytest.raises(ValueError, match="needs workflow_class"):
        AgentTrainer(_config(), backend="skyrl")


def test_hydra_plugin_teaches_an_rllm_app_the_skyrl_backend(tmp_path):
    """rLLM's scripts import AgentTrainer and compose rLLM's config: with `rllm/backend=skyrl` and
    nothing else changed, AgentTrainer(backend=config.rllm.backend) builds our launcher."""
    result = _run_python(
        """
        import json
        import hydra
        from rllm.trainer import AgentTrainer
        from rllm.workflows.simple_workflow import SimpleWorkflow

        @hydra.main(config_path="pkg://rllm.trainer.config", config_name="unified", version_base=None)
        def main(config):
            trainer = AgentTrainer(config=config, workflow_class=SimpleWorkflow, backend=config.rllm.backend)
            print(json.dumps({"launcher": type(trainer.launcher).__name__, "model": config.model.name}))

        main()
        """,
        cwd=tmp_path,
        args=["rllm/backend=skyrl", "model.name=tiny", f"hydra.run.dir={tmp_path}/run"],
    )
    assert result == {"launcher": "SkyRLTrainerLauncher", "model": "tiny"}


# --- failures leave nothing running ---------------------------------------------------------------------


class FailingUpdateBackend(SkyRLBackend):
    last: FailingUpdateBackend | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        FailingUpdateBackend.last = self

    async def update_policy(self, trainer_state, **kwargs):
        self.server_processes = list(self.runtime.servers.processes)
        raise RuntimeError("optimizer blew up")


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_failing_step_stops_servers_and_workers(tmp_path):
    cfg = rllm_config(
        tmp_path,
        *DIGITS,
        "training.group_size=2",
        "data.train_batch_size=2",
        "rllm.trainer.total_batches=1",
        "rllm.trainer.val_before_train=false",
    )
    launcher = SkyRLTrainerLauncher(
        cfg,
        workflow_class=_simple_workflow(),
        workflow_args={"reward_function": digit_reward},
        train_dataset=digit_rows(4),
        backend_cls=FailingUpdateBackend,
    )
    with pytest.raises(RuntimeError, match="optimizer blew up"):
        launcher.train()
    backend = FailingUpdateBackend.last
    assert backend.runtime is None
    assert all(process.poll() is not None for process in backend.server_processes)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_a_trainer_that_fails_to_build_stops_the_backend_it_started(tmp_path, monkeypatch):
    """rLLM builds its workflow engine after the backend started Ray workers and servers; a failure
    there must not leave them running."""
    from rllm.trainer import unified_trainer

    def broken_engine(**kwargs):
        backend = FailingUpdateBackend.last
        backend.server_processes = list(backend.runtime.servers.processes)
        raise ValueError("max_workers must be greater than 0")

    monkeypatch.setattr(unified_trainer, "UnifiedWorkflowEngine", broken_engine)
    cfg = rllm_config(tmp_path, *DIGITS, "training.group_size=2", "data.train_batch_size=2")
    launcher = SkyRLTrainerLauncher(
        cfg,
        workflow_class=_simple_workflow(),
        workflow_args={"reward_function": digit_reward},
        train_dataset=digit_rows(4),
        backend_cls=FailingUpdateBackend,
    )
    with pytest.raises(ValueError, match="max_workers"):
        launcher.train()
    backend = FailingUpdateBackend.last
    assert backend.runtime is None and not list(SkyRLBackend._running)
    assert all(process.poll() is not None for process in backend.server_processes)


# --- the backend's side of the contract ---------------------------------------------------------------


def test_skyrl_backend_implements_rllms_backend_protocol():
    """Every method of rLLM's BackendProtocol exists here with compatible parameters and the same
    sync/async-ness, so rLLM's calls bind."""
    from rllm.trainer.backend_protocol import BackendProtocol

    for name, theirs in inspect.getmembers(BackendProtocol, inspect.isfunction):
        if name.startswith("_"):
            continue
        ours = getattr(SkyRLBackend, name)
        assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(theirs), name
        parameters = [p for p in inspect.signature(theirs).parameters.values() if p.kind != p.VAR_KEYWORD]
        arguments = {p.name: object() for p in parameters if p.kind != p.VAR_POSITIONAL}
        inspect.signature(ours).bind(**arguments)


def test_skyrl_backend_constructs_and_validates_as_rllm_does(tmp_path):
    """rLLM's trainer: ``backend_cls(config=config, **backend_args)``, then ``validate_config()``."""
    cfg = rllm_config(tmp_path, "model.name=tiny")
    backend = SkyRLBackend(config=cfg)
    backend.validate_config()
    assert backend.rollout_engine is None and backend.tokenizer is None  # set by init_rollout_engine
    assert Path(backend.run.model_path).is_dir()
    # model.name is an alias the backend alone reads: the trainer's config keeps model.path unset
    assert OmegaConf.is_missing(cfg.model, "path")


# --- Hydra search path ------------------------------------------------------------------------------

STAND_IN_RLLM_CONFIG = {
    "unified.yaml": "defaults:\n  - rllm: base\n  - rllm/backend: verl\n  - _self_\n",
    "rllm/base.yaml": "marker: stand_in_rllm_base\ntrainer: {project_name: p, experiment_name: e}\n",
    "rllm/backend/verl.yaml": "# @package _global_\nverl_only: true\n",
}


def test_search_path_plugin_resolves_skyrl_backend_and_shadows_nothing(tmp_path):
    """Another app's config directory (here a stand-in for rLLM's layout): `rllm/backend=skyrl`
    resolves, the app's own files always win, and our stand-in `unified`/`rllm/base` never leak."""
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
    assert skyrl["model"]["path"] == "tiny" and skyrl["skyrl"]["trainer"]["strategy"] == "fsdp"
    assert "verl_only" not in skyrl
    assert result["default"]["verl_only"] is True and "skyrl" not in result["default"]
    assert "skyrl" in result["unknown"] and "verl" in result["unknown"]  # Hydra lists both options
    assert "Cannot find primary config 'unified'" in result["our_unified"]
    assert "Cannot find primary config 'rllm/base'" in result["our_base"]
    assert result["own_file_wins"] == {"own": 1}


def test_real_rllm_unified_config_composes_with_skyrl_backend(tmp_path):
    from omegaconf import OmegaConf as OC

    from rllm_skyrl.run_config import BRIDGE, make_skyrl_config, skyrl_overrides

    cfg = rllm_config(tmp_path, "model.path=tiny", "training.group_size=4")
    skyrl_cfg = make_skyrl_config(skyrl_overrides(cfg))
    assert {"model", "rllm", "skyrl", "training", "inference", "data"} <= set(cfg.keys())
    assert "gateway" in cfg.rllm  # rLLM's own rllm/base, not our stand-in
    sources = [key for pair in BRIDGE for key in pair.sources]
    assert [key for key in sources if OC.select(cfg, key, default=KeyError) is KeyError] == []
    assert cfg.rllm.rollout.n == skyrl_cfg.generator.n_samples_per_prompt == 4
    assert skyrl_cfg.trainer.train_batch_size == cfg.rllm.data.train_batch_size
    assert cfg.rllm.algorithm.rollout_correction.bypass_mode is True
    assert OC.select(cfg, "rllm.remote_runtime.enabled") is False
