"""Everything SkyRL 0.4 needs to run its real FSDP workers on a machine without CUDA.

SkyRL's workers assume CUDA in a handful of places (process-group backend, device meshes,
``torch.cuda.*`` device calls); besides the missing flash-attn (``flash_attn.py``) those are the
only obstacles on CPU: the math is device-agnostic. No patch changes numerics: each redirects a
device choice ("cuda" to "cpu") or turns a CUDA-only synchronisation into a no-op.
"""

from __future__ import annotations

import functools

import torch

from rllm_skyrl.compat.patch import Patch


def _gloo_process_group() -> None:
    """SkyRL asks for ``cpu:gloo,cuda:nccl``; NCCL cannot initialise without a GPU."""
    import torch.distributed as dist

    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        if backend is None or "nccl" in str(backend):
            backend = "gloo"
        return original(backend, *args, **kwargs)

    dist.init_process_group = init_process_group


def _cpu_device_mesh() -> None:
    import torch.distributed.device_mesh as device_mesh

    original = device_mesh.init_device_mesh

    @functools.wraps(original)
    def init_device_mesh(device_type, *args, **kwargs):
        return original("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    device_mesh.init_device_mesh = init_device_mesh
    # fsdp_utils imported the name directly, so rebind it there too.
    from skyrl.backends.skyrl_train.distributed import fsdp_utils

    fsdp_utils.init_device_mesh = init_device_mesh


def _cuda_set_device_noop() -> None:
    torch.cuda.set_device = lambda device: None


def _cuda_current_device_cpu() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")


def _cuda_synchronize_noop() -> None:
    """CPU kernels are synchronous; there is nothing to wait for."""
    torch.cuda.synchronize = lambda device=None: None


def _tensor_cuda_identity() -> None:
    """``buf.cuda()`` (used to broadcast buffers between ranks) keeps the tensor where it is."""

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        return self

    torch.Tensor.cuda = cuda


def _empty_on_cpu() -> None:
    """Receive buffers allocated with ``device="cuda"`` are allocated on the CPU."""
    original = torch.empty

    @functools.wraps(original)
    def empty(*args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return original(*args, device=device, **kwargs)

    torch.empty = empty


_W = "skyrl.backends.skyrl_train.workers.worker"
_U = "skyrl.backends.skyrl_train.distributed.fsdp_utils"
_S = "skyrl.backends.skyrl_train.distributed.fsdp_strategy"

PATCHES: tuple[Patch, ...] = (
    Patch("gloo_process_group", (_W, "Worker.init_worker_process_group", "cuda:nccl"), _gloo_process_group),
    Patch("cpu_device_mesh", (_U, "create_device_mesh", 'init_device_mesh("cuda"'), _cpu_device_mesh),
    Patch(
        "cuda_set_device_noop",
        (_S, "FSDPStrategy.setup_distributed", "torch.cuda.set_device"),
        _cuda_set_device_noop,
    ),
    Patch(
        "cuda_current_device_cpu",
        (_U, "load_fsdp2_model_to_gpu", "torch.cuda.current_device()"),
        _cuda_current_device_cpu,
    ),
    Patch(
        "cuda_synchronize_noop",
        (_S, "FSDPStrategy.save_checkpoint", "torch.cuda.synchronize()"),
        _cuda_synchronize_noop,
    ),
    Patch("tensor_cuda_identity", (_U, "", ".cuda()"), _tensor_cuda_identity),
    Patch("empty_on_cpu", (_U, "", 'torch.empty(buf.shape, dtype=buf.dtype, device="cuda")'), _empty_on_cpu),
)

_applied = False


def apply() -> None:
    """Install every patch, once per process (the patches themselves do not check), only without CUDA."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    for patch in PATCHES:
        patch.install()
    _applied = True


def is_applied() -> bool:
    return _applied
