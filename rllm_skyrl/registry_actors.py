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


def start_registry_actors(names: list[str]) -> None:
    """One ``FunctionStore`` per registry actor name, unless an actor of that name already runs.

    Returns once they answer: until then Ray may not resolve their names yet, and SkyRL, finding
    none, would start its own.
    """
    no_patches = {"env_vars": {compat.ENV_VAR: ""}}
    for name in names:
        _handles[name] = FunctionStore.options(name=name, get_if_exists=True, runtime_env=no_patches).remote()
    ray.get([_handles[name].list_available.remote() for name in names])
