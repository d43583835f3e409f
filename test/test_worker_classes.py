"""The workers' actor classes: the driver builds them without SkyRL, a worker process gets SkyRL's.

Each check that imports SkyRL runs in a fresh interpreter, so that "without SkyRL" means it.
"""

from __future__ import annotations

import pytest
from helpers import run_python

from rllm_skyrl import worker_classes, workers


def test_the_table_is_skyrls_instance_methods_sync_and_async():
    """The names a handle is built from are exactly the instance methods of SkyRL's class (with
    this platform's patches applied, as in a worker): a method missing here could not be called."""
    program = """
        import inspect, json
        from ray._private.inspect_util import is_function_or_method
        from rllm_skyrl.hardware import Platform
        from rllm_skyrl.worker_classes import SKYRL_CLASSES, skyrl_class
        Platform.detect().prepare_process()
        found = {}
        for name in SKYRL_CLASSES:
            cls = skyrl_class(name)
            methods = {
                method: inspect.iscoroutinefunction(function)
                for method, function in inspect.getmembers(cls, predicate=is_function_or_method)
                if not isinstance(inspect.getattr_static(cls, method), (staticmethod, classmethod))
            }
            found[name] = methods
        print(json.dumps(found))
    """
    found = run_python(program)
    for name, methods in found.items():
        assert sorted(worker_classes.METHODS[name]) == sorted(methods), name
        assert {m for m in worker_classes.METHODS[name] if m in worker_classes.ASYNC_METHODS} == {
            m for m, is_async in methods.items() if is_async
        }, name


def test_the_driver_builds_the_classes_without_skyrl_and_a_worker_unpickles_skyrls():
    """What Ray ships to a worker for the policy class: built in a process that never imports
    SkyRL's worker module, it loads, in another, as a subclass of SkyRL's class whose methods are
    SkyRL's own functions (Ray's tracing wrappers around them), so the worker runs SkyRL's code."""
    built = run_python("""
        import base64, json, sys
        from ray import cloudpickle
        from rllm_skyrl.worker_classes import actor_class
        modified = actor_class("policy").__ray_metadata__.modified_class
        print(json.dumps({
            "pickled": base64.b64encode(cloudpickle.dumps(modified)).decode(),
            "skyrl_imported": "skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker" in sys.modules,
            "torch_imported": "torch" in sys.modules,
        }))
    """)
    assert not built["skyrl_imported"] and not built["torch_imported"]
    loaded = run_python(
        """
        import base64, inspect, json, sys
        from ray import cloudpickle
        from rllm_skyrl.hardware import Platform
        Platform.detect().prepare_process()  # as the workers' set-up hook does
        from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase
        from rllm_skyrl.worker_classes import METHODS
        cls = cloudpickle.loads(base64.b64decode(sys.argv[1]))
        code = lambda owner, name: inspect.unwrap(getattr(owner, name))
        print(json.dumps({
            "base": cls.__mro__[1] is FSDPPolicyWorkerBase,
            "not_skyrls": [
                name
                for name in METHODS["PolicyWorker"]
                if code(cls, name) is not code(FSDPPolicyWorkerBase, name)
            ],
        }))
        """,
        built["pickled"],
    )
    assert loaded == {"base": True, "not_skyrls": []}


def test_a_stand_in_method_refuses_to_run_in_the_driver():
    stand_in = worker_classes.actor_class("ref").__ray_metadata__.modified_class.__mro__[1]
    with pytest.raises(RuntimeError, match="RefWorker.forward is a stand-in"):
        stand_in.forward(object())


# --------------------------------------------------------------------------- early actors


class _Recorder:
    """An actor class that records what it was asked to create."""

    def __init__(self) -> None:
        self.created: list[tuple[dict, dict]] = []

    def options(self, **options):
        recorder = self

        class _Call:
            def remote(self, **kwargs):
                recorder.created.append((options, kwargs))
                return f"actor-{len(recorder.created)}"

        return _Call()


@pytest.fixture
def fake_actors(monkeypatch):
    recorder, killed = _Recorder(), []
    monkeypatch.setattr(worker_classes, "actor_class", lambda role: recorder)
    monkeypatch.setattr(workers.ray, "kill", lambda handle, no_restart=True: killed.append(handle))
    return recorder, killed


def test_skyrl_gets_the_early_actor_when_it_asks_for_exactly_that_one(fake_actors):
    recorder, killed = fake_actors
    early = workers.EarlyActor({"num_cpus": 1}, {"rank": 0}, "early")
    actor_type = workers._ActorType("policy", early)
    assert actor_type.options(num_cpus=1).remote(rank=0) == "early"
    assert actor_type.adopted and not killed and not recorder.created
    assert actor_type.options(num_cpus=1).remote(rank=1) == "actor-1"  # the next rank is new
    actor_type.stop_unused()
    assert not killed


def test_an_early_actor_skyrl_does_not_ask_for_is_stopped_before_another_is_created(fake_actors, caplog):
    recorder, killed = fake_actors
    actor_type = workers._ActorType("policy", workers.EarlyActor({"num_cpus": 1}, {"rank": 0}, "early"))
    assert actor_type.options(num_cpus=1).remote(rank=0, world_size=2) == "actor-1"
    assert killed == ["early"] and not actor_type.adopted
    assert "another policy worker than the one started early" in caplog.text
    unasked = workers._ActorType("ref", workers.EarlyActor({}, {}, "early-ref"))
    unasked.stop_unused()
    assert killed == ["early", "early-ref"]


def test_early_actors_are_rank_zero_with_skyrls_options_and_only_without_a_placement_group(fake_actors):
    recorder, _ = fake_actors
    from omegaconf import OmegaConf

    def config(**placement):
        base = {"colocate_all": False, "policy_num_nodes": 1, "policy_num_gpus_per_node": 1}
        return OmegaConf.create(
            {
                "trainer": {
                    "placement": {**base, **placement},
                    "policy": {"sequence_parallel_size": 1},
                }
            }
        )

    cfg = config()
    early = workers.start_early(cfg, roles=("policy",))
    ((options, kwargs),) = recorder.created
    assert options == {"num_cpus": 1, "num_gpus": 1, "resources": None}
    assert kwargs["rank"] == 0 and kwargs["world_size"] == 1 and kwargs["master_addr"] is None
    assert early["policy"].handle == "actor-1"
    assert workers.start_early(config(policy_num_gpus_per_node=2), roles=("policy",)) == {}
    assert workers.start_early(config(colocate_all=True), roles=("policy",)) == {}
    assert len(recorder.created) == 1


def test_a_config_changed_after_the_early_start_gets_a_new_actor(fake_actors):
    """The early actor was created with the config as it was: SkyRL asking with the same object,
    changed since, gets a new actor (and the early one is stopped)."""
    recorder, killed = fake_actors
    from omegaconf import OmegaConf

    placement = {"colocate_all": False, "policy_num_nodes": 1, "policy_num_gpus_per_node": 1}
    cfg = OmegaConf.create({"trainer": {"placement": placement, "policy": {"sequence_parallel_size": 1}}})
    early = workers.start_early(cfg, roles=("policy",))
    options, kwargs = recorder.created[0]
    cfg.trainer.policy.sequence_parallel_size = 1  # unchanged: still that actor
    assert workers._ActorType("policy", early["policy"]).create(options, kwargs) == "actor-1"
    cfg.trainer.policy.optimizer = "changed"
    assert workers._ActorType("policy", early["policy"]).create(options, kwargs) == "actor-2"
    assert killed == ["actor-1"]
