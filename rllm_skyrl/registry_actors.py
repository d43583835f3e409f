"""The named Ray actors that hold SkyRL's function registries, started without torch.

SkyRL shares its policy-loss and advantage-estimator registries between the driver and every
worker through one named actor each, so that a function registered in the driver is found in the
workers. Its actor class lives in a module that imports torch, and every Ray process of a run
applies this package's SkyRL patches (which import torch and SkyRL's worker modules) when it
starts: each of the two processes spent seconds, on two cores five, importing what a dict of
pickled functions does not need. ``FunctionStore`` answers the same four calls from a module that
imports only Ray, in processes given no patch set. SkyRL looks its actors up by name and creates
its own only when none exists, so started first under SkyRL's names, these are the ones every
process uses.
"""

from __future__ import annotations

import ray

from rllm_skyrl import compat

# SkyRL's ``PolicyLossRegistry._actor_name`` and ``AdvantageEstimatorRegistry._actor_name``.
REGISTRY_ACTOR_NAMES = ("policy_loss_registry", "advantage_estimator_registry")
# The creator's handles, held for the run: Ray stops an actor once its creator holds no handle.
_handles: dict[str, ray.actor.ActorHandle] = {}


@ray.remote(num_cpus=0)
class FunctionStore:
    """Pickled functions by name: the calls SkyRL's ``RegistryActor`` answers, nothing else."""

    def __init__(self) -> None:
        self.functions: dict[str, bytes] = {}

    def register(self, name: str, func_serialized: bytes) -> None:
        self.functions[name] = func_serialized

    def get(self, name: str) -> bytes | None:
        return self.functions.get(name)

    def list_available(self) -> list[str]:
        return list(self.functions)

    def unregister(self, name: str) -> bytes | None:
        return self.functions.pop(name, None)


def start_registry_actors() -> None:
    """A ``FunctionStore`` under each of SkyRL's registry actor names, unless one already runs.

    Call right after ``ray.init``, before any process of the run imports SkyRL's ``ppo_utils`` with
    Ray up (its import registers the built-in functions, creating SkyRL's own actors if none
    exist). Does not wait for the processes: a named actor is found by name from its creation on.
    """
    no_patches = {"env_vars": {compat.ENV_VAR: ""}}
    for name in REGISTRY_ACTOR_NAMES:
        _handles[name] = FunctionStore.options(name=name, get_if_exists=True, runtime_env=no_patches).remote()


def sync_skyrl_registries() -> None:
    """SkyRL's ``sync_registries``: functions registered in this process reach the actors, and from
    them every worker that looks one up; call after ``start_registry_actors``, before the workers
    build their models."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry, PolicyLossRegistry

    for registry in (PolicyLossRegistry, AdvantageEstimatorRegistry):
        registry.sync_with_actor()
