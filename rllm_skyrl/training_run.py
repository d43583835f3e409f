"""One training run, whichever trainer drives it: build it, fit, always shut down, and report.

Every entry comes here (the examples' Hydra apps, and rLLM's ``AgentTrainer(backend="skyrl")``
through ``rllm_plugin``), so every run gets the same around its trainer: secrets masked in all it
prints, the import-time patch sets before the heavy imports, Ray launched beside those imports on a
CPU machine, ``metrics.jsonl``, a progress bar, ``metrics.png`` and a summary, one line for a
setting to fix, and a clean stop on Ctrl-C or SIGTERM with Ray, workers and servers gone.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from rllm_skyrl import rllm_names

if TYPE_CHECKING:
    from rllm_skyrl.secret_masking import SecretMasker


def train(
    config: DictConfig,
    workflow_class: str | type | None,
    workflow_args: dict[str, Any] | None = None,
    train_dataset: Any = None,
    val_dataset: Any = None,
    *,
    trainer_cls: type | None = None,
    backend_cls: type | None = None,
    backend_args: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> Path:
    """Train with the SkyRL backend; returns the run directory (``rllm.trainer.run_dir``).

    ``workflow_class`` may be a dotted path, rLLM's included (``rllm_names.resolve``), so it is
    imported only once Ray is on its way; None with an ``agent_flow`` and ``evaluator`` (rLLM's
    trainer only). ``trainer_kwargs`` reach the trainer (rLLM's take ``agent_flow``, ``evaluator``,
    ``hooks``, ``traj_group_adv_estimator_map``, ``store``...).
    """
    from rllm_skyrl.compat import local_ray
    from rllm_skyrl.compat.output_masking import mask_process_output
    from rllm_skyrl.run.exits import one_line_errors
    from rllm_skyrl.run_config import check_settings

    masker = mask_process_output(_plain(config))  # first: an error below may quote a secret
    with one_line_errors():
        check_settings(config)  # a wrong value costs no start-up: nothing has started yet
    local = local_ray.launch_for_cpu_run()  # on a CPU machine: Ray in its own process, beside our imports
    try:
        return _train(
            config,
            masker,
            workflow_class,
            workflow_args,
            train_dataset,
            val_dataset,
            trainer_cls,
            backend_cls,
            backend_args,
            trainer_kwargs,
        )
    finally:
        if local is not None:  # the runtime stopped it already, unless the run ended before it started
            local_ray.stop(local)


def _check_teacher(config: DictConfig, workflow_args: dict[str, Any]) -> None:
    """A distillation teacher against the student's tokenizer, before anything starts; rLLM's
    distillation workflow fixed (``compat.rllm_distill_rewards``)."""
    from rllm_skyrl.rollout.teacher import check_teacher
    from rllm_skyrl.run_config import resolve_run_config
    from rllm_skyrl.runtime import load_tokenizer

    check_teacher(workflow_args, load_tokenizer(resolve_run_config(config).model_path))
    from rllm_skyrl import compat

    compat.apply(["rllm_distill_rewards"])  # a teacher's workflow is rLLM's: rLLM is installed


def _plain(config: DictConfig) -> Any:
    """The config as plain values for finding its secrets: resolved where it resolves."""
    try:
        return OmegaConf.to_container(config, resolve=True, throw_on_missing=False)
    except Exception:  # an interpolation that cannot resolve yet: its error belongs to the trainer
        return OmegaConf.to_container(config, resolve=False)


def _train(
    config: DictConfig,
    masker: SecretMasker,
    workflow_class: str | type | None,
    workflow_args: dict[str, Any] | None,
    train_dataset: Any,
    val_dataset: Any,
    trainer_cls: type | None,
    backend_cls: type | None,
    backend_args: dict[str, Any] | None,
    trainer_kwargs: dict[str, Any],
) -> Path:
    from rllm_skyrl import compat
    from rllm_skyrl.secret_masking import scrub_hydra_outputs

    scrub_hydra_outputs(masker)
    compat.prepare_imports()  # before the backend's and the trainer's imports (see each set)
    from rllm_skyrl.backend import SkyRLBackend
    from rllm_skyrl.run.console import ProgressBar, finish_run, trainer_output
    from rllm_skyrl.run.exits import clean_stop, one_line_errors
    from rllm_skyrl.run.metrics_file import MetricsSink
    from rllm_skyrl.run_config import with_aliases

    compat.apply(["quiet_logs"])
    with one_line_errors():
        config = with_aliases(config)  # the trainer reads rllm.* keys that an alias may set
        if (workflow_args or {}).get("teacher_engine") is not None:
            _check_teacher(config, workflow_args)
    run_dir = Path(OmegaConf.select(config, "rllm.trainer.run_dir", default="logs/rllm-skyrl"))
    loggers = OmegaConf.select(config, "rllm.trainer.logger", default=["console"])
    on_console = "console" in ([loggers] if isinstance(loggers, str) else list(loggers))
    console = sys.stderr  # the progress bar's: the console, also while the trainer's output is moved
    with clean_stop():
        trainer = None
        try:
            with one_line_errors(), trainer_output(run_dir, masker, on_console):
                trainer = (trainer_cls or rllm_names.UnifiedTrainer)(
                    backend_cls=backend_cls or SkyRLBackend,
                    config=config,
                    workflow_class=None if workflow_class is None else rllm_names.resolve(workflow_class),
                    train_dataset=train_dataset,
                    val_dataset=val_dataset,
                    workflow_args=workflow_args or {},
                    backend_args=backend_args,
                    **trainer_kwargs,
                )
            progress = ProgressBar(console)
            sinks = {
                "metrics_jsonl": MetricsSink(run_dir, lambda: getattr(trainer.backend, "resumed_step", None)),
                "progress_bar": progress,
            }
            if hasattr(trainer.logger, "add_sinks"):  # the fallback trainer's own Tracking
                trainer.logger.add_sinks(sinks)
            else:
                compat.apply(["rllm_tracking"], trainer.logger, sinks)
            try:
                with trainer_output(run_dir, masker, on_console):
                    trainer.fit()
            finally:
                progress.close()
        finally:
            try:
                if trainer is not None:
                    with trainer_output(run_dir, masker, on_console):
                        trainer.shutdown()
            finally:  # what the trainer did not stop: its build failed after the backend had started
                SkyRLBackend.shutdown_all()
    finish_run(run_dir)
    return run_dir
