"""Every change this package makes at run time to another library, in one table: ``PATCH_SETS``.

A *patch set* is one module of this package, with an ``apply()``, that changes SkyRL, torch,
transformers, Ray, rLLM, loguru or the process's output streams and signals; every set is applied
through ``apply([name])`` by the code that needs it (its ``applies`` says where), so the table is
what runs. README's "Patches" table is generated from it. On CUDA SkyRL's training code is its stock
code but for the bug fixes (a crash or a wrong result, each with a test that reproduces it on
unpatched SkyRL); what is done for speed applies on CPU only. The ``process`` and ``integration``
sets act on the driver process (its output, logs and signals) and on rLLM's entry points, not on
SkyRL's training code: they apply on every platform.

On a version a set was not verified on, a speed, process or integration set is skipped with one
warning and the run goes on without it; a set without which nothing runs here (``cpu``) or that
fixes a bug is applied with a warning instead, and skipped only when what it changes is no longer
there. ``RLLM_SKYRL_COMPAT_DISABLE=a,b`` turns sets off by name. Ray workers get the driver's
training-path sets through ``worker_process_setup_hook`` (``ray_runtime_env``). A set's module is
imported only when applied.
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

BUG, ENABLES, SPEED = "bug fix", "enables", "speed"
PROCESS, INTEGRATION = "process", "integration"  # the driver process; rLLM's entry points

# The environment the test suite and bench/README.md's figures ran in.
SKYRL, TORCH, TRANSFORMERS, RAY, RLLM, LOGURU = "0.4.0", "2.13.0", "5.16.1", "2.57.0", "0.3.0rc0", "0.7.3"
PYTHON = "3.12"

# ``applies`` of the sets every Ray worker gets too, applied before SkyRL's worker modules load.
TRAINING_PATH = "SkyRL's training path (compat.prepare_driver, then every Ray worker)"


def _always(platform: Platform) -> bool:
    return True


def _cpu(platform: Platform) -> bool:
    return not platform.cuda


def _without_flash_attn(platform: Platform) -> bool:
    return not platform.flash_attn


@dataclass(frozen=True)
class PatchSet:
    """One row of the table. ``summary``: what it does, in a line (``rllm-skyrl plan`` prints it).
    ``applies``: where it is applied, and on what. ``when``: the platforms it applies on.
    ``training_path``: applied by ``prepare_driver`` and in every Ray worker (else the code named in
    ``applies`` calls ``apply``). ``verified`` maps a distribution (or
    ``python``) to the versions checked. ``each_call``: its ``apply(*args)`` runs at every request,
    on what the run built (a trainer's tracking, the handler a ``ray.init`` installed); the others
    run once per process.
    """

    name: str
    purpose: str
    summary: str
    applies: str
    why: str
    gain: str
    upstream: str
    verified: Mapping[str, tuple[str, ...]]
    when: Callable[[Platform], bool] = _always
    training_path: bool = False
    each_call: bool = False
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
        "transformers' tables of installed packages and model modules read from a file",
        f"CPU; {TRAINING_PATH}, and the CPU server",
        "transformers rebuilds two tables of what is installed in every process that imports it; "
        "they are read from a file per environment instead",
        "start-up time (bench/README.md: 'Start-up')",
        "transformers: build the tables lazily or keep them per environment",
        {"transformers": (TRANSFORMERS,)},
        when=_cpu,
        training_path=True,
    ),
    PatchSet(
        "lazy_imports",
        SPEED,
        "wandb, datasets and pandas imported on first use",
        f"CPU; {TRAINING_PATH}",
        "wandb, datasets and pandas, which SkyRL's modules import at their top and a training "
        "worker never uses, run on first use",
        "start-up time (bench/README.md: 'Start-up')",
        "SkyRL: import wandb, transformers.trainer and skyrl_gym's SQL tool where they are used",
        {"skyrl": (SKYRL,), "transformers": (TRANSFORMERS,)},
        when=_cpu,
        training_path=True,
    ),
    PatchSet(
        "registries",
        SPEED,
        "SkyRL's loss and advantage registries in Ray's key-value store",
        f"CPU; {TRAINING_PATH}",
        "SkyRL's loss and advantage-estimator registries live in Ray's key-value store instead of "
        "two named actors (two worker processes)",
        "start-up time, two worker processes fewer (bench/README.md: 'Start-up')",
        "SkyRL: keep the registries in Ray's internal key-value store",
        {"skyrl": (SKYRL,), "ray": (RAY,)},
        when=_cpu,
        training_path=True,
    ),
    PatchSet(
        "flash_attn_stub",
        BUG,
        "SkyRL's workers import without flash-attn",
        f"flash-attn not installed (always on CPU; on CUDA unless added); {TRAINING_PATH}",
        "SkyRL's model wrapper imports flash_attn.bert_padding whatever trainer.flash_attn says: "
        "without flash-attn its workers cannot be imported",
        "SkyRL's workers import at all (sdpa attention)",
        "SkyRL: import flash_attn.bert_padding where remove_microbatch_padding uses it",
        {"skyrl": (SKYRL,)},
        when=_without_flash_attn,
        training_path=True,
        module="flash_attn",
    ),
    PatchSet(
        "cpu",
        ENABLES,
        "SkyRL's FSDP workers on CPU (gloo)",
        f"CPU; {TRAINING_PATH}",
        "SkyRL's workers ask for NCCL, CUDA device meshes and torch.cuda device calls",
        "SkyRL's FSDP workers train on CPU (gloo)",
        "SkyRL: a device setting (cpu beside cuda, gloo beside NCCL)",
        {"skyrl": (SKYRL,), "torch": (TORCH,)},
        when=_cpu,
        training_path=True,
    ),
    PatchSet(
        "tied_embeddings",
        BUG,
        "tied embeddings re-tied after SkyRL's FSDP set-up",
        f"everywhere (CUDA too); {TRAINING_PATH}",
        "SkyRL's FSDP set-up moves the model to the meta device, which gives lm_head a parameter "
        "of its own: a tied model trains untied and drifts from what vLLM serves",
        "tied models stay tied (rollout and trainer log-probs agree)",
        "SkyRL: re-tie after the meta move and after loading the state dict (FSDPStrategy)",
        {"skyrl": (SKYRL,), "transformers": (TRANSFORMERS,)},
        training_path=True,
    ),
    PatchSet(
        "response_logits",
        SPEED,
        "the LM head over the response window only, a prompt's samples packed",
        f"CPU; {TRAINING_PATH}",
        "SkyRL's forward runs the LM head, log-softmax and entropy at every position, prompt "
        "included; here over the response window only, and a prompt's samples as one packed row",
        "step time (bench/README.md: 'A step')",
        "SkyRL: logits_to_keep in HFModelWrapper.forward (helps GPUs too)",
        {"skyrl": (SKYRL,), "transformers": (TRANSFORMERS,), "torch": (TORCH,)},
        when=_cpu,
        training_path=True,
    ),
    PatchSet(
        "local_ray",
        SPEED,
        "the run's own Ray head without dashboard head and monitors",
        "CPU, no Ray cluster named or running; launched by training_run.train, joined by "
        "ray_cluster.start_ray",
        "ray.init starts a dashboard head, an autoscaler monitor and a log monitor a run does not "
        "use (two of them serve metrics without authentication); the run's own head starts "
        "without, with Ray's private settings for a CPU run",
        "start-up time (bench/README.md: 'Start-up'); no unauthenticated metrics ports",
        "Ray: a flag to start a head node without dashboard head and monitors",
        {"ray": (RAY,)},
        when=_cpu,
        each_call=True,
    ),
    PatchSet(
        "output_masking",
        PROCESS,
        "secrets masked in the console, logs and tracebacks",
        "every run's driver, at its first line (training_run.train; rllm-skyrl plan, train and "
        "sft); again for each secret learned later",
        "secrets from the environment and the config must not reach the console or logs; the "
        "process's stdout, stderr, excepthook, log handlers and loguru's records are wrapped",
        "secrets masked from the first line of output",
        "none: a process-level concern of this package",
        {"python": (PYTHON,), "loguru": (LOGURU,)},
    ),
    PatchSet(
        "quiet_logs",
        PROCESS,
        "SkyRL's, Ray's and httpx's console logs at WARNING, other loguru sinks kept",
        "every run's driver, after output_masking (training_run.train; rllm-skyrl plan, train and sft)",
        "SkyRL logs its start-up notes and every HTTP request at INFO and DEBUG; the console keeps "
        "the run's progress, warnings and errors (RLLM_SKYRL_LOG_LEVEL=INFO brings them back); "
        "loguru's default stderr sink is replaced, every other sink left as it is",
        "a console that shows the run",
        "none: a process-level concern of this package",
        {"skyrl": (SKYRL,), "loguru": (LOGURU,)},
    ),
    PatchSet(
        "sigterm",
        PROCESS,
        "SIGTERM unwinds a run as Ctrl-C does, Ray's driver handler replaced",
        "every run's driver, right after ray.init (ray_cluster.start_ray)",
        "ray.init installs a SIGTERM handler that raises SystemExit wherever the signal lands, "
        "often inside an HTTP client's task, which dies of it; the handler is replaced by one that "
        "cancels the run's event loop as Ctrl-C does",
        "SIGTERM stops a run as Ctrl-C does: no traceback, its finally blocks run",
        "Ray: leave a handler the application installed before ray.init in place",
        {"ray": (RAY,), "python": (PYTHON,)},
        each_call=True,
    ),
    PatchSet(
        "rllm_agent_trainer",
        INTEGRATION,
        "rLLM's AgentTrainer builds this backend for backend='skyrl' only",
        "rllm_plugin.register(), which the Hydra plug-in calls in an app that imported rLLM's "
        "trainer; changes AgentTrainer for backend='skyrl' (or the config group rllm/backend=skyrl) "
        "only",
        "rLLM's AgentTrainer picks its launcher with an if/elif over backend names and has no "
        "table to add one to; its constructor is wrapped, and passes every other backend to rLLM's "
        "own untouched",
        "rLLM's scripts run with only the backend switched",
        "rLLM: a backend registry (entry points) for AgentTrainer",
        {"rllm": (RLLM,)},
        each_call=True,
    ),
    PatchSet(
        "rllm_gateway",
        INTEGRATION,
        "rLLM's model gateway serves SkyRL's engine, on 127.0.0.1 with the run's token",
        "every run's driver under rLLM's trainer where rLLM is installed, when the backend validates "
        "its config (backend.SkyRLBackend); acts when an AgentFlow starts the gateway",
        "rLLM's model gateway finds the inference servers by the engine's class name (Tinker's, "
        "verl's) and registers none for SkyRL's engine; it also listens on every interface without a "
        "credential. For an engine that lists its servers it runs in a process of its own (rLLM's "
        "process mode, which rLLM's trainer picks for verl only), listens on 127.0.0.1 and forwards to "
        "them with the run's token",
        "AgentFlow + Evaluator training on SkyRL; no gateway port reachable from another machine; the "
        "gateway's HTTP work off the driver's GIL",
        "rLLM: register the workers of any engine with a server_addresses attribute, and bind the "
        "gateway to rllm.gateway.host",
        {"rllm": (RLLM,)},
    ),
    PatchSet(
        "rllm_sft_trainer",
        INTEGRATION,
        "rLLM's AgentSFTTrainer dispatches backend='skyrl' to SkyRL's SFT trainer",
        "rllm_plugin.register() (rLLM installed), also for rllm-skyrl sft; changes "
        "AgentSFTTrainer's backend choice for the names in its table (skyrl) only",
        "rLLM's AgentSFTTrainer picks its backend with an if-chain in _make_backend and has no table "
        "to add one to; the method is wrapped to look names up in a table first (skyrl)",
        "AgentSFTTrainer(spec, backend='skyrl') and rllm-skyrl sft train on SkyRL's own SFT trainer",
        "rLLM: a backend table for AgentSFTTrainer",
        {"rllm": (RLLM,)},
        each_call=True,
    ),
    PatchSet(
        "rllm_tracking",
        INTEGRATION,
        "metrics.jsonl and the progress bar added to rLLM's Tracking",
        "every run's driver under rLLM's trainer, once the trainer is built (training_run.train)",
        "rLLM's trainer builds its Tracking from logger names and takes no logger object; the "
        "run's metrics.jsonl and progress bar are added to its table of loggers",
        "metrics.jsonl, the progress bar, the plot and the summary under rLLM's trainer",
        "rLLM: let UnifiedTrainer take logger objects",
        {"rllm": (RLLM,)},
        each_call=True,
    ),
    PatchSet(
        "rllm_metrics_table",
        SPEED,
        "rLLM's per-step metrics table written as plain lines",
        "CPU; rLLM's trainer, its output moved to trainer_output.log (console not in "
        "rllm.trainer.logger; run.console.trainer_output)",
        "rLLM's trainer lays out a rich table of every metric after each step, also when nobody sees "
        "it; the same rows are written as plain lines",
        "wall time under rLLM's trainer (bench/README.md: 'A step')",
        "rLLM: print the metrics table only with the console logger",
        {"rllm": (RLLM,)},
        when=_cpu,
        each_call=True,
    ),
    PatchSet(
        "rllm_distill_rewards",
        BUG,
        "rLLM's DistillationWorkflow episodes get their trajectory rewards however they end",
        "every run's driver with a distillation teacher (workflow_args.teacher_engine), before the "
        "trainer is built (training_run.train)",
        "rLLM's DistillationWorkflow returns its episodes without trajectory rewards, but those cut "
        "at max_response_length get them: a group holding both fails rLLM's transform at step 1",
        "distillation trains (examples/distill) instead of failing its first step",
        "rLLM: DistillationWorkflow.run returns self.postprocess_episode(...) as other workflows do",
        {"rllm": (RLLM,)},
    ),
)
BY_NAME = {patch_set.name: patch_set for patch_set in PATCH_SETS}
# Without these nothing runs here, the result is wrong, or secrets reach the console.
APPLY_UNVERIFIED = frozenset(p.name for p in PATCH_SETS if p.purpose in (BUG, ENABLES)) | {"output_masking"}

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


def disabled() -> frozenset[str]:
    """The sets ``RLLM_SKYRL_COMPAT_DISABLE`` turns off."""
    return frozenset(name.strip() for name in os.environ.get(DISABLE_VAR, "").split(",") if name.strip())


def usable(names: Iterable[str]) -> list[str]:
    """``names`` in application order, minus the disabled sets and the speed and integration sets
    this environment's versions were not verified for (each skipped with one warning)."""
    wanted = set(names)
    unknown = sorted(wanted - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown patch set(s) {unknown}; known: {sorted(BY_NAME)}")
    wanted -= disabled()
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


def apply(names: Iterable[str], *args: Any, platform: Platform | None = None) -> list[str]:
    """Apply the usable sets among ``names`` (on ``platform``, if given, those whose ``when`` holds);
    returns those in effect. A set's ``apply`` runs once per process, or at every call with ``args``
    for an ``each_call`` set (what it changes is built per run).

    A set that fails to install on a version it was not verified on (what it changes has moved)
    is skipped with a warning; on a verified version the error is raised: it is a bug here.
    """
    names = list(names)
    if platform is not None:
        names = [name for name in names if name not in BY_NAME or BY_NAME[name].when(platform)]
    chosen = usable(names)
    if args and any(not BY_NAME[name].each_call for name in chosen):
        raise TypeError(f"only an each_call set takes arguments, not {chosen}")
    done = []
    for name in chosen:
        if name not in _applied or BY_NAME[name].each_call:
            try:
                importlib.import_module(BY_NAME[name].module_name).apply(*args)
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
    """The sets of SkyRL's training path on ``platform``, in application order."""
    return tuple(p.name for p in PATCH_SETS if p.training_path and p.when(platform))


def on_platform(platform: Platform) -> tuple[PatchSet, ...]:
    """Every set a run on ``platform`` applies where its ``applies`` says (rLLM's when it is used)."""
    return tuple(p for p in PATCH_SETS if p.when(platform))


def this_machine() -> Platform:
    """CPU or CUDA for a driver-side set, known without importing torch (as ``prepare_imports``)."""
    return Platform(cuda=has_nvidia_driver())


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
    names = usable(for_platform(platform))
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
