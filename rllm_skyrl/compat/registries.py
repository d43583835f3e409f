"""SkyRL's function registries shared through Ray's key-value store instead of two named actors.

SkyRL shares its policy-loss and advantage-estimator registries between the driver and the
workers (so a custom loss registered in the driver is found in them) through a named Ray actor
each: a worker process holding a dict. On two cores the two took core-seconds of start-up
(bench/README.md: 'Start-up') and two of Ray's worker-start slots (the training worker waited
behind them), and every process that imported SkyRL's losses with Ray up made a round trip per
built-in function. Here a registry is a namespace of the GCS key-value store every process
reaches (``ray.experimental.internal_kv``, also across nodes) answering the actor's four calls;
SkyRL's register / get / sync / unregister code runs unchanged around it.

``ppo_utils`` registers the built-ins when imported, in every process: ``apply`` imports it first
with those registrations kept local, as without Ray, then installs the store.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

from rllm_skyrl.compat.patch import Patch

NAMESPACE = "rllm_skyrl_function_registries"
_PPO_UTILS = "skyrl.backends.skyrl_train.utils.ppo_utils"
# What ``ppo_utils`` imports, loaded before it so that only its own body runs with Ray hidden.
_PPO_UTILS_IMPORTS = (
    "numpy",
    "torch",
    "jaxtyping",
    "loguru",
    "skyrl.backends.skyrl_train.utils.off_policy_correction_utils",
    "skyrl.backends.skyrl_train.utils.torch_utils",
    "skyrl.train.config",
)


class _Call:
    """A store operation called the way SkyRL calls an actor method: ``.remote(...)`` -> a ref."""

    def __init__(self, operation: Callable[..., Any]) -> None:
        self._operation = operation

    def remote(self, *args: Any) -> Any:
        import ray

        return ray.put(self._operation(*args))


class KeyValueRegistry:
    """One registry's pickled functions in Ray's key-value store, under ``<registry>/<name>``."""

    def __init__(self, registry: str) -> None:
        self.prefix = f"{registry}/"
        self.register = _Call(self._register)
        self.get = _Call(self._get)
        self.list_available = _Call(self._list)
        self.unregister = _Call(self._unregister)

    def _key(self, name: str) -> bytes:
        return f"{self.prefix}{name}".encode()

    def _register(self, name: str, func_serialized: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self._key(name), func_serialized, overwrite=True, namespace=NAMESPACE)

    def _get(self, name: str) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(self._key(name), namespace=NAMESPACE)

    def _list(self) -> list[str]:
        from ray.experimental import internal_kv

        keys = internal_kv._internal_kv_list(self.prefix, namespace=NAMESPACE)
        return [key.decode()[len(self.prefix) :] for key in keys]

    def _unregister(self, name: str) -> bytes | None:
        from ray.experimental import internal_kv

        value = self._get(name)
        internal_kv._internal_kv_del(self._key(name), namespace=NAMESPACE)
        return value

    def clear(self) -> None:
        for name in self._list():
            self._unregister(name)


def _store(cls) -> KeyValueRegistry:
    """Replaces ``_get_or_create_actor``: this registry's store; a new Ray session syncs anew."""
    import ray

    if not ray.is_initialized():
        raise Exception("Ray is not initialized, cannot create registry actor")  # SkyRL's error
    session = ray.get_runtime_context().gcs_address
    if getattr(cls, "_rllm_skyrl_session", None) != session:
        cls._rllm_skyrl_session = session
        cls._synced_to_actor = False
    cls._ray_actor = KeyValueRegistry(cls._actor_name)
    return cls._ray_actor


def _sync_with_store(cls) -> None:
    """SkyRL's ``sync_with_actor`` (push the local functions once, pull the ones missing here),
    minus its ``ray.get_actor`` check for a stale actor: ``_store`` notices a new session."""
    import cloudpickle
    import ray

    if not ray.is_initialized():
        raise Exception("Ray is not initialized, cannot sync with actor")  # SkyRL's error
    store = cls._get_or_create_actor()
    cls._sync_local_to_actor()
    for name in store._list():
        if name not in cls._functions:
            func_serialized = store._get(name)
            if func_serialized is not None:
                cls._functions[name] = cloudpickle.loads(func_serialized)


def _registries_in_the_key_value_store() -> None:
    if _PPO_UTILS not in sys.modules:
        import ray

        for name in _PPO_UTILS_IMPORTS:
            importlib.import_module(name)
        is_initialized = ray.is_initialized
        ray.is_initialized = lambda: False  # meanwhile: what SkyRL registers stays in-process
        try:
            importlib.import_module(_PPO_UTILS)
        finally:
            ray.is_initialized = is_initialized
    registry = sys.modules[_PPO_UTILS].BaseFunctionRegistry
    if getattr(registry.sync_with_actor, "_rllm_skyrl_patched", False):
        return
    original_reset = registry.reset.__func__

    @functools.wraps(original_reset)
    def reset(cls):
        import ray

        if ray.is_initialized():
            KeyValueRegistry(cls._actor_name).clear()
        original_reset(cls)

    for name, replacement in (
        ("_get_or_create_actor", _store),
        ("sync_with_actor", _sync_with_store),
        ("reset", reset),
    ):
        replacement._rllm_skyrl_patched = True
        setattr(registry, name, classmethod(replacement))


PATCHES: tuple[Patch, ...] = (
    Patch(
        "registries",
        (  # the class's source, read from its file: unchanged once the methods are replaced
            _PPO_UTILS,
            "BaseFunctionRegistry",
            "RegistryActor.options(name=cls._actor_name, get_if_exists=True).remote()",
        ),
        _registries_in_the_key_value_store,
    ),
)


def apply() -> None:
    """Install the store (idempotent), importing SkyRL's registries with local registrations first."""
    for patch in PATCHES:
        patch.install()
