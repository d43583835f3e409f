"""Every change this package makes at run time to another library, in one table: ``PATCH_SETS``.

A *patch set* is one module of this package that changes SkyRL, torch, transformers, Ray, rLLM or
the process's output streams; README's "Patches" table is generated from this one. On CUDA the run
is SkyRL's stock code but for the bug fixes (a crash or a wrong result, each with a test that
reproduces it on unpatched SkyRL); what is done for speed applies on CPU only.

On a version a set was not verified on, a speed or integration set is skipped with one warning and
the run trains without it; a set without which nothing runs here (``cpu``) or that fixes a bug is
applied with a warning instead, and skipped only when what it changes is no longer there.
``RLLM_SKYRL_COMPAT_DISABLE=a,b`` turns sets off by name. Ray workers get the driver's sets through
``worker_process_setup_hook`` (``ray_runtime_env``). A set's module is imported only when applied.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rllm_skyrl.hardware import Platform, has_nvidia_driver

logger = logging.getLogger(__name__)

SETUP_HOOK = "rllm_skyrl.compat.apply_from_env"
ENV_VAR = "RLLM_SKYRL_COMPAT"
DISABLE_VAR = "RLLM_SKYRL_COMPAT_DISABLE"

BUG, ENABLES, SPEED, INTEGRATION = "bug fix", "enables", "speed", "integration"

# The environment the test suite and the README's figures ran in.
SKYRL, TORCH, TRANSFORMERS, RAY, RLLM = "0.4.0", "2.13.0", "5.16.1", "2.57.0", "0.3.0rc0"


def _always(platform: Platform) -> bool:
    return True


def _cpu(platform: Platform) -> bool:
    return not platform.cuda


def _without_flash_attn(platform: Platform) -> bool:
    return not platform.flash_attn


@dataclass(frozen=True)
class PatchSet:
    """``when`` picks the platforms it applies on for SkyRL's training path (``None``: applied where
    the code that needs it names it, described by ``applies``). ``verified`` maps a distribution
    (or ``python``) to the versions checked. ``in_workers``: also applied in every Ray worker.
    """

    name: str
    purpose: str
    applies: str
    why: str
    gain: str
    upstream: str
    verified: Mapping[str, tuple[str, ...]]
    when: Callable[[Platform], bool] | None = None
    in_workers: bool = True
    module: str = ""

    @property
    def module_name(self) -> str:
        return f"{__name__}.{self.module or self.name}"


PATCH_SETS: tuple[PatchSet, ...] = (
    # Application order: import-time sets first (before what they change is imported), then the
    # stub, before the sets that import SkyRL's worker modules.
    PatchSet(
        "transformers_import_cache",
        SPEED,
        "CPU",
        "transformers rebuilds two tables of what is installed in every process that imports it; "
        "they are read from a file per environment instead",
        "quickstart start-up 12.1 s without, 10.5 s with (1.16x)",
        "transformers: build the tables lazily or keep them per environment",
        {"transformers": (TRANSFORMERS,)},
        when=_cpu,
    ),
    PatchSet(
        "lazy_imports",
        SPEED,
        "CPU",
        "wandb, datasets and pandas, which SkyRL's modules import at their top and a training "
        "worker never uses, run on first use",
        "quickstart start-up 11.7 s without, 10.5 s with (1.12x)",
        "SkyRL: import wandb, transformers.trainer and skyrl_gym's SQL tool where they are used",
        {"skyrl": (SKYRL,), "transformers": (TRANSFORMERS,)},
        when=_cpu,
    ),
    PatchSet(
        "registries",
        SPEED,
        "CPU",
        "SkyRL's loss and advantage-estimator registries live in Ray's key-value store instead of "
        "two named actors (two worker processes)",
        "quickstart start-up 19.3 s without, 10.5 s with (1.84x): two worker processes fewer",
        "SkyRL: keep the registries in Ray's internal key-value store",
        {"skyrl": (SKYRL,), "ray": (RAY,)},
        when=_cpu,
    ),
    PatchSet(
        "flash_attn_stub",
        BUG,
        "flash-attn not installed (always on CPU; on CUDA unless added)",
        "SkyRL's model wrapper imports flash_attn.bert_padding whatever trainer.flash_attn says: "
        "without flash-attn its workers cannot be imported",
        "SkyRL's workers import at all (sdpa attention)",
        "SkyRL: import flash_attn.bert_padding where remove_microbatch_padding uses it",
        {"skyrl": (SKYRL,)},
        when=_without_flash_attn,
        module="flash_attn",
    ),
    PatchSet(
        "cpu",
        ENABLES,
        "CPU",
        "SkyRL's workers ask for NCCL, CUDA device meshes and torch.cuda device calls",
        "SkyRL's FSDP workers train on CPU (gloo)",
        "SkyRL: a device setting (cpu beside cuda, gloo beside NCCL)",
        {"skyrl": (SKYRL,), "torch": (TORCH,)},
        when=_cpu,
    ),
    PatchSet(
        "tied_embeddings",
        BUG,
        "everywhere (CUDA too)",
        "SkyRL's FSDP set-up moves the model to the meta device, which gives lm_head a parameter "
        "of its own: a tied model trains untied and drifts from what vLLM serves",
        "tied models stay tied (rollout and trainer log-probs agree)",
        "SkyRL: re-tie after the meta move and after loading the state dict (FSDPStrategy)",
        {"skyrl": (SKYRL,), "transformers": (TRANSFORMERS,)},
        when=_always,
    ),
    PatchSet(
        "response_logits",
        SPEED,
        "CPU",
        "SkyRL's forward runs the LM head, log-softmax and entropy at every position, prompt "
        "included; here over the response window only, and a prompt's samples as one packed row",
        "quickstart step 0.266 s without, 0.183 s with (1.45x); "
        "SmolLM2 step 69.9 s without, 57.3 s with (1.22x)",
        "SkyRL: logits_to_keep in HFModelWrapper.forward (helps GPUs too)",
        {"skyrl": (SKYRL,), "transformers": (TRANSFORMERS,), "torch": (TORCH,)},
        when=_cpu,
    ),
    PatchSet(
        "local_ray",
        SPEED,
        "CPU, no Ray cluster named or running",
        "ray.init starts a dashboard head, an autoscaler monitor and a log monitor a run does not "
        "use (two of them serve metrics without authentication); the run's own head starts without",
        "quickstart start-up 12.4 s without, 10.0 s with (1.24x, four rounds); no unauthenticated "
        "metrics ports",
        "Ray: a flag to start a head node without dashboard head and monitors",
        {"ray": (RAY,)},
        in_workers=False,
    ),
    PatchSet(
        "output_masking",
        INTEGRATION,
        "every run (the driver)",
        "secrets from the environment and the config must not reach the console or logs; the "
        "process's stdout and stderr are wrapped",
        "secrets masked from the first line of output",
        "none: a process-level concern of this package",
        {"python": ("3.12",)},
        in_workers=False,
    ),
    PatchSet(
        "rllm_agent_trainer",
        INTEGRATION,
        "rllm_plugin.register() (rLLM installed)",
        "rLLM's AgentTrainer picks its launcher with an if/elif over backend names and has no "
        "table to add one to; its constructor is wrapped for backend='skyrl'",
        "rLLM's scripts run with only the backend switched",
        "rLLM: a backend registry (entry points) for AgentTrainer",
        {"rllm": (RLLM,)},
        in_workers=False,
    ),
    PatchSet(
        "rllm_gateway",
        INTEGRATION,
        "rLLM's trainer with an AgentFlow (the driver)",
        "rLLM's model gateway finds the inference servers by the engine's class name (Tinker's, "
        "verl's) and registers none for SkyRL's engine; it also listens on every interface without a "
        "credential. For an engine that lists its servers it listens on 127.0.0.1 and forwards to them "
        "with the run's token",
        "AgentFlow + Evaluator training on SkyRL; no gateway port reachable from another machine",
        "rLLM: register the workers of any engine with a server_addresses attribute, and bind the "
        "gateway to rllm.gateway.host",
        {"rllm": (RLLM,)},
        in_workers=False,
    ),
    PatchSet(
        "rllm_tracking",
        INTEGRATION,
        "every run (the driver), under either trainer",
        "rLLM's trainer builds its Tracking from logger names and takes no logger object; the "
        "run's metrics.jsonl and progress bar are added to its table of loggers",
        "metrics.jsonl, the progress bar, the plot and the summary under rLLM's trainer",
        "rLLM: let UnifiedTrainer take logger objects",
        {"rllm": (RLLM,)},
        in_workers=False,
    ),
    PatchSet(
        "rllm_metrics_table",
        SPEED,
        "rLLM's trainer, its output moved to trainer_output.log (console not in rllm.trainer.logger)",
        "rLLM's trainer lays out a rich table of every metric after each step, also when nobody sees "
        "it; the same rows are written as plain lines",
        "60-step quickstart 34.5 s without, 28.8 s with (wall, median of 5 alternating runs; paired 0.95x)",
        "rLLM: print the metrics table only with the console logger",
        {"rllm": (RLLM,)},
        in_workers=False,
    ),
)
BY_NAME = {patch_set.name: patch_set for patch_set in PATCH_SETS}
# Without these nothing runs here, or the result is wrong.
APPLY_UNVERIFIED = frozenset(p.name for p in PATCH_SETS if p.purpose in (BUG, ENABLES))

_applied: set[str] = set()
_warned: set[str] = set()


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (``python``: the interpreter's), or None."""
    if distribution == "python":
        return "{}.{}.{}".format(*sys.version_info[:3])
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _matches(version: str | None, verified: tuple[str, ...]) -> bool:
    """``3.12`` verifies every ``3.12.x``; a full version only itself."""
    return version is not None and any(version == v or version.startswith(f"{v}.") for v in verified)


def unverified(name: str) -> list[str]:
    """The installed versions set ``name`` was not verified on, as ``"skyrl 0.4.1"``."""
    return [
        f"{distribution} {installed_version(distribution)}"
        for distribution, versions in BY_NAME[name].verified.items()
        if not _matches(installed_version(distribution), versions)
    ]


def _warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        logger.warning("%s", message)


def usable(names: Iterable[str]) -> list[str]:
    """``names`` in application order, minus the disabled sets and the speed and integration sets
    this environment's versions were not verified for (each skipped with one warning)."""
    wanted = set(names)
    unknown = sorted(wanted - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown patch set(s) {unknown}; known: {sorted(BY_NAME)}")
    wanted -= {name for name in os.environ.get(DISABLE_VAR, "").split(",") if name}
    chosen = []
    for patch_set in [p for p in PATCH_SETS if p.name in wanted]:
        name = patch_set.name
        versions = unverified(name)
        if versions:
            found = (
                f"rllm_skyrl: patch set {name!r} was verified on {_verified_text(name)}, not on "
                f"{', '.join(versions)}"
            )
            if name not in APPLY_UNVERIFIED:
                _warn_once(name, f"{found}: skipped ({patch_set.why}); training runs without it")
                continue
            _warn_once(name, f"{found}: applied anyway ({patch_set.why})")
        chosen.append(name)
    return chosen


def _verified_text(name: str) -> str:
    return ", ".join(f"{d} {'/'.join(v)}" for d, v in BY_NAME[name].verified.items())


def apply(names: Iterable[str]) -> list[str]:
    """Install the usable sets among ``names``, each once per process; returns those applied.

    A set that fails to install on a version it was not verified on (what it changes has moved)
    is skipped with a warning; on a verified version the error is raised: it is a bug here.
    """
    done = []
    for name in usable(names):
        if name not in _applied:
            try:
                importlib.import_module(BY_NAME[name].module_name).apply()
            except (AttributeError, ImportError) as error:
                if not unverified(name):
                    raise
                _warn_once(f"{name}:failed", f"rllm_skyrl: patch set {name!r} could not be applied: {error}")
                continue
            _applied.add(name)
        done.append(name)
    return done


def applied() -> frozenset[str]:
    return frozenset(_applied)


def for_platform(platform: Platform) -> tuple[str, ...]:
    """The sets that apply to SkyRL's training path on ``platform``, in application order."""
    return tuple(p.name for p in PATCH_SETS if p.when is not None and p.when(platform))


def prepare_driver(platform: Platform) -> list[str]:
    return apply(for_platform(platform))


# Sets that act when what they change is imported: applied before that, as early as a run can.
IMPORT_TIME = ("transformers_import_cache", "lazy_imports")


def prepare_imports() -> list[str]:
    """The import-time sets at a run's first line where there is no NVIDIA driver (a CPU run, known
    without importing torch); a CPU run on a machine with one gets them later from ``prepare_driver``."""
    if has_nvidia_driver():
        return []
    return apply(name for name in for_platform(Platform(cuda=False)) if name in IMPORT_TIME)


def ray_runtime_env(platform: Platform) -> dict[str, Any]:
    """Runtime-env entries that give every Ray worker the sets the driver applies."""
    names = [name for name in usable(for_platform(platform)) if BY_NAME[name].in_workers]
    return {"worker_process_setup_hook": SETUP_HOOK, "env_vars": {ENV_VAR: ",".join(names)}}


def apply_from_env() -> None:
    """Ray's worker set-up hook: the sets the driver listed in ``RLLM_SKYRL_COMPAT``."""
    apply(name for name in os.environ.get(ENV_VAR, "").split(",") if name)


def table_markdown() -> str:
    """The README's table of patch sets, from ``PATCH_SETS``."""
    lines = [
        "| set | applies | why | gain | upstream change that retires it | verified on |",
        "|---|---|---|---|---|---|",
    ]
    for p in PATCH_SETS:
        lines.append(
            f"| `{p.name}` ({p.purpose}) | {p.applies} | {p.why} | {p.gain} | {p.upstream} | "
            f"{_verified_text(p.name)} |"
        )
    return "\n".join(lines)
