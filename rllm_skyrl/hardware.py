"""CPU or CUDA, decided once: which servers roll out, how weights reach them, what Ray offers.

Everything that differs between a GPU cluster and a laptop is answered by one ``Platform`` object,
built once per run (``Platform.detect()``) and asked by everyone else. The SkyRL patches live in
``compat/``; this module only decides which of them apply.

| question | CUDA | CPU |
|---|---|---|
| servers (``server_kind``) | SkyRL's vLLM servers | this package's transformers servers |
| weight sync (``weight_sync_method``) | SkyRL's own transfer | HF save + reload; LoRA: adapter files |
| Ray resources (``ray_resources``) | what Ray detects | logical GPUs (a scheduling token) |
| priority of Ray's workers (``ray_system_config``) | Ray's (niceness 15) | the driver's (niceness 0) |
| SkyRL settings (``skyrl_overrides``) | sdpa without flash-attn | sdpa, ``cpu.CPU_CONFIG_OVERRIDES`` |
| FSDP re-gathers each layer for the backward (``reshard_after_forward``) | yes (SkyRL's default) | no |
| SkyRL patches (``compat_patches``) | all but ``cpu``; the stub only without flash-attn | all nine |

flash-attn is optional on CUDA (PyPI has no wheels for it): without it SkyRL trains with sdpa.

Servers given by URL (``inference.urls``) are used on either platform.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rllm_skyrl import compat
from rllm_skyrl.compat import flash_attn

# Logical GPUs offered on a CPU-only machine: enough for policy, critic and ref at data-parallel
# size 2 each. They only gate scheduling; nothing runs on them.
CPU_LOGICAL_GPUS = 8

SERVER_KINDS = ("external", "skyrl_vllm", "cpu_transformers")
SYNC_METHODS = ("skyrl", "disk", "lora")


@dataclass(frozen=True)
class Platform:
    """Where a run trains and serves. ``cuda=False`` means SkyRL's workers run on CPU (gloo)."""

    cuda: bool
    flash_attn: bool = False

    @classmethod
    def detect(cls) -> Platform:
        """This machine: CUDA if torch sees a GPU; flash-attn if it is installed (never used on CPU)."""
        from rllm_skyrl.compat import cpu  # imports torch, which a launcher starting Ray need not

        cuda = cpu.cuda_available()
        return cls(cuda=cuda, flash_attn=cuda and flash_attn.available())

    @classmethod
    def gpu_cluster(cls) -> Platform:
        """The platform ``rllm-skyrl plan`` describes from any machine: CUDA with flash-attn."""
        return cls(cuda=True, flash_attn=True)

    @property
    def name(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def server_kind(self, urls: list[str] | tuple[str, ...] | None) -> str:
        """Given URLs, else SkyRL's vLLM servers on CUDA, else this package's CPU servers."""
        if urls:
            return "external"
        return "skyrl_vllm" if self.cuda else "cpu_transformers"

    def weight_sync_method(self, lora: bool = False) -> str:
        """``skyrl`` on CUDA, ``lora`` or ``disk`` on CPU.

        ``skyrl``: ``save_weights_for_sampler``, SkyRL's transfer into vLLM; for a LoRA policy SkyRL
        writes the adapter and has vLLM load it. On CPU that call cannot run (its set-up needs vLLM),
        so a LoRA policy takes SkyRL's adapter sync directly (``lora``: the worker writes the adapter
        and asks every server to load it), and full weights go through ``disk`` (HF save, then the
        server's own reload endpoint: SkyRL has no from-disk path for full weights).
        """
        if self.cuda:
            return "skyrl"
        return "lora" if lora else "disk"

    @property
    def reshard_after_forward(self) -> bool:
        """SkyRL's default for the trained models' ``fsdp_config.reshard_after_forward`` here.

        Resharding frees each layer's gathered weights after the forward and gathers them again
        for the backward: GPU memory saved for a second copy. On CPU memory is not the limit and
        the copy is time (6% of a SmolLM2-135M forward-backward), so the weights stay gathered.
        """
        return self.cuda

    def ray_resources(self, num_cpus: int | None = None) -> dict[str, Any]:
        """Arguments for a local ``ray.init``: logical GPUs on CPU so SkyRL's placement runs unchanged."""
        if self.cuda:
            return {}
        return {"num_gpus": CPU_LOGICAL_GPUS, "num_cpus": num_cpus or CPU_LOGICAL_GPUS}

    def ray_system_config(self) -> dict[str, Any]:
        """Ray settings for a local start on this platform.

        Ray runs its workers at niceness 15, below the driver and Ray's own daemons. On CPU the
        training worker is where the compute is, and it shares the cores with the inference
        server (niceness 0): every wake-up of another process then pre-empts one of the worker's
        OpenMP threads, and the others wait for it at the next barrier. At the driver's priority
        the quickstart's forward-backward took 2-4% less time.
        """
        return {} if self.cuda else {"worker_niceness": 0}

    def skyrl_overrides(self) -> dict[str, Any]:
        """SkyRL config values this platform forces over the user's (they cannot work otherwise)."""
        overrides: dict[str, Any] = {}
        if not self.flash_attn:
            overrides.update(flash_attn.CONFIG_OVERRIDES)
        if not self.cuda:
            from rllm_skyrl.compat import cpu

            overrides.update(cpu.CPU_CONFIG_OVERRIDES)
        return overrides

    @property
    def compat_patches(self) -> tuple[str, ...]:
        """The ``compat`` patch sets SkyRL needs here (in the driver and in every worker, but for
        ``compat.DRIVER_ONLY``)."""
        names = ["package_index", "lazy_imports", "registries_in_gcs"]
        if not self.flash_attn:
            names.append("flash_attn_stub")
        if not self.cuda:
            names.append("cpu")
        return (*names, "tied_embeddings", "response_logits", "memory_snapshots", "single_rank_reductions")

    def prepare_process(self) -> None:
        """Make this process (the driver) able to import and drive SkyRL's workers."""
        compat.apply(self.compat_patches)

    def ray_runtime_env(self) -> dict[str, Any]:
        """Runtime-env entries every Ray worker needs: the same patches (but the driver's own),
        through Ray's set-up hook."""
        return {
            "worker_process_setup_hook": compat.SETUP_HOOK,
            "env_vars": {
                compat.ENV_VAR: ",".join(p for p in self.compat_patches if p not in compat.DRIVER_ONLY)
            },
        }
