"""SkyRL's FSDP worker actor classes, for a process that has not imported them.

Ray creates an actor from its class, so the driver had to import SkyRL's worker module (torch,
transformers and SkyRL's training stack: seconds) before the training worker's process could even
start, and that process then imported the same again: start-up paid both imports one after the
other. A class here is SkyRL's worker as a Ray handle sees it (the same instance methods, by name,
so sync or async), built from this table and Ray alone.

The actor is still SkyRL's class, because of how Ray ships an actor class: its methods, and the
class it derives from, are pickled by reference to ``rllm_skyrl.worker_classes.<Name>``. In the
driver that name is the stand-in; in a worker process, which never builds the stand-ins, the
module's ``__getattr__`` resolves it to SkyRL's class. So the worker runs SkyRL's methods and
nothing of this module, and the driver can start it while it imports its own modules.
``test_worker_classes`` checks the table against the installed SkyRL.
"""

from __future__ import annotations

import importlib
from typing import Any

import ray

_SKYRL_MODULE = "skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker"
# Our name (in a Ray process title: ``ray::PolicyWorker.forward_backward``) -> SkyRL's class.
SKYRL_CLASSES = {
    "PolicyWorker": "FSDPPolicyWorkerBase",
    "CriticWorker": "FSDPCriticWorkerBase",
    "RefWorker": "FSDPRefWorkerBase",
}
ROLE_CLASSES = {"policy": "PolicyWorker", "critic": "CriticWorker", "ref": "RefWorker"}

# The instance methods of SkyRL's classes (static methods are left out, as Ray leaves them alone).
_REF_METHODS = (
    "__init__",
    "_build_draft_weight_source",
    "_build_weight_source",
    "_expandable_segments_disabled_for_sync",
    "_forward_micro_batch",
    "_get_module_for_offload",
    "_reset_prefix_cache_task",
    "_seq_parallel_monkey_patch",
    "_set_expandable_segments",
    "_set_numa_affinity",
    "_should_reset_prefix_cache",
    "_sync_weights_to_inference_engines",
    "_weight_sync_thread",
    "backload_to_gpu",
    "dump_profiler_summary",
    "empty_cache",
    "finalize_pending_saves",
    "forward",
    "get_cuda_memory",
    "get_gpu_id",
    "get_lr",
    "get_master_addr_port",
    "get_mesh_rank",
    "get_node_local_rank",
    "get_ray_node_id",
    "init_model",
    "init_weight_sync_state",
    "init_worker_process_group",
    "load_checkpoint",
    "offload_to_cpu",
    "profile_step",
    "save_checkpoint",
    "save_hf_model",
    "save_memory_snapshot",
    "set_algorithm_config",
    "set_lr",
    "start_profile",
    "stop_profile",
)
_CRITIC_METHODS = (
    *_REF_METHODS,
    "_forward_backward_micro",
    "_set_pad_token_id",
    "forward_backward",
    "optim_step",
)
METHODS = {
    "RefWorker": _REF_METHODS,
    "CriticWorker": _CRITIC_METHODS,
    "PolicyWorker": (
        *_CRITIC_METHODS,
        "_adapter_store_unsupported",
        "_forward_micro_with_loss",
        "_resolve_lora_sync_target",
        "_save_lora_adapters_and_sync",
        "adapter_store_state",
        "broadcast_to_inference_engines",
        "delete_adapter",
        "prime_optimizer_state",
        "register_adapter",
        "register_pristine_adapter",
        "swap_to_adapter",
    ),
}
ASYNC_METHODS = frozenset(
    {
        "_save_lora_adapters_and_sync",
        "_sync_weights_to_inference_engines",
        "broadcast_to_inference_engines",
        "init_weight_sync_state",
    }
)

_actor_classes: dict[str, Any] = {}


def actor_class(role: str) -> Any:
    """The Ray actor class of ``role``'s SkyRL worker (``ray.remote(num_gpus=1)``, as SkyRL's)."""
    name = ROLE_CLASSES[role]
    if name not in _actor_classes:
        stand_in = type(
            name,
            (),
            {
                "__module__": __name__,
                "__qualname__": name,
                "__doc__": f"SkyRL's {SKYRL_CLASSES[name]}, as a Ray handle sees it.",
                **{method: _stand_in_method(name, method) for method in METHODS[name]},
            },
        )
        globals()[name] = stand_in  # what this process pickles by reference from now on
        _actor_classes[name] = ray.remote(num_gpus=1)(stand_in)
    return _actor_classes[name]


def skyrl_class(name: str) -> type:
    """SkyRL's class behind one of our names (imports SkyRL's worker module)."""
    return getattr(importlib.import_module(_SKYRL_MODULE), SKYRL_CLASSES[name])


def __getattr__(name: str) -> type:
    """In a worker process, where no stand-in was built: the class Ray unpickles is SkyRL's."""
    if name in SKYRL_CLASSES:
        return skyrl_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _stand_in_method(class_name: str, name: str):
    """Never runs: a worker unpickles SkyRL's method of this name in its place."""
    if name in ASYNC_METHODS:

        async def method(self, *args, **kwargs):
            raise RuntimeError(f"{class_name}.{name} is a stand-in; it runs only as SkyRL's method")

    else:

        def method(self, *args, **kwargs):
            raise RuntimeError(f"{class_name}.{name} is a stand-in; it runs only as SkyRL's method")

    method.__name__ = name
    method.__qualname__ = f"{class_name}.{name}"
    method.__module__ = __name__
    return method
