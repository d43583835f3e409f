"""One place where metrics leave the process: console, ``metrics.jsonl``, wandb, and plots.

``metrics.jsonl`` in the run directory is always written (one object per logged step:
``{"step": 3, "reward/mean": 0.4, ...}``) because ``plot_run`` and resume read it. The
``console`` logger prints one line per step under a tqdm bar that shows the live reward (log
records are routed through the bar so they do not tear it). The ``wandb`` logger runs offline
unless online mode is asked for (``wandb_mode`` or ``WANDB_MODE``) *and* ``WANDB_API_KEY`` is set.
``finish`` draws ``metrics.png`` (reward, validation pass@1, KL, step time); ``python -m
rllm_skyrl.plot RUN_DIR`` draws it on demand.

Secrets stay out of everything written (``secret_masking``): the config dump, wandb's config and
the command line wandb records.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rllm_skyrl.compat import output_masking
from rllm_skyrl.metrics import KL_KEYS
from rllm_skyrl.plot import plot_run
from rllm_skyrl.run_log import MetricsFile
from rllm_skyrl.secret_masking import redact, scrub_hydra_outputs

logger = logging.getLogger(__name__)

KNOWN_LOGGERS = ("console", "wandb")


def _first_key(metrics: Mapping[str, Any], candidates: Iterable[str]) -> str | None:
    return next((k for k in candidates if metrics.get(k) is not None), None)


def console_line(step: int, total_steps: int | None, metrics: Mapping[str, Any]) -> str:
    """``step 3/20 | reward 0.412 | val/math/pass@1 0.300 | kl 0.0012 | 1.84 s/step``."""
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    if metrics.get("reward/mean") is not None:
        parts.append(f"reward {metrics['reward/mean']:.3f}")
    parts += [f"{k} {v:.3f}" for k, v in sorted(metrics.items()) if k.endswith("/pass@1") and v is not None]
    kl_key = _first_key(metrics, KL_KEYS)
    if kl_key:
        parts.append(f"kl {metrics[kl_key]:.4g}")
    if metrics.get("time/step") is not None:
        parts.append(f"{metrics['time/step']:.2f} s/step")
    return " | ".join(parts)


def _wandb_mode(requested: str | None) -> str:
    mode = (requested or os.environ.get("WANDB_MODE") or "offline").lower()
    if mode == "online" and not os.environ.get("WANDB_API_KEY"):
        logger.warning("wandb online mode asked for but WANDB_API_KEY is not set; logging offline")
        return "offline"
    return mode


class Tracking:
    """Logs metrics by step to the run directory and to the chosen loggers."""

    def __init__(
        self,
        run_dir: str | Path,
        project_name: str = "rllm-training",
        experiment_name: str = "default",
        loggers: Iterable[str] = ("console",),
        config: Mapping[str, Any] | None = None,
        wandb_mode: str | None = None,
        plot: bool = True,
    ) -> None:
        self.loggers = list(loggers)
        unknown = sorted(set(self.loggers) - set(KNOWN_LOGGERS))
        if unknown:
            raise ValueError(f"unknown logger(s) {unknown}; choose from {list(KNOWN_LOGGERS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsFile(self.run_dir)
        self.metrics_path = self.metrics.path
        self.plot = plot
        config = dict(config or {})
        self.masker = output_masking.mask_process_output(config)
        safe_config = self.masker.mask_tree(redact(config))
        (self.run_dir / "config.json").write_text(json.dumps(safe_config, indent=2, default=str))
        scrub_hydra_outputs(self.masker)
        self.total_steps: int | None = None
        self._bar: tqdm | None = None
        self._log_redirect = None
        self._wandb_run = None
        if "wandb" in self.loggers:
            import wandb

            argv = sys.argv
            sys.argv = self.masker.mask_argv(argv)  # wandb records the command line in the run
            try:
                self._wandb_run = wandb.init(
                    project=project_name,
                    name=experiment_name,
                    dir=str(self.run_dir),
                    mode=_wandb_mode(wandb_mode),
                    config=safe_config,
                )
            finally:
                sys.argv = argv

    def start(self, total_steps: int, resume_step: int) -> None:
        """Begin (or resume after ``resume_step``) a run of ``total_steps`` steps.

        Records of later steps in ``metrics.jsonl`` belong to a run that died after its last
        checkpoint (or to an earlier run in the same directory); they are dropped so the file
        has one history.
        """
        self.total_steps = total_steps
        self.metrics.keep_through(resume_step if resume_step > 0 else -1)  # a fresh run keeps nothing
        if "console" in self.loggers:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(
                total=total_steps, initial=resume_step, desc="training", unit="step", dynamic_ncols=True
            )
            if any(_is_console_handler(h) for h in logging.getLogger().handlers):
                self._log_redirect = logging_redirect_tqdm()  # log lines above the bar, not through it
                self._log_redirect.__enter__()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        record = self.metrics.append(step, metrics)
        record.pop("step")
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in record.items() if v is not None}, step=step)
        if "console" in self.loggers:
            line = console_line(step, self.total_steps, record)
            if self._bar is None:
                print(line)
                return
            self._bar.write(line)
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            if record.get("reward/mean") is not None:
                self._bar.set_postfix(reward=f"{record['reward/mean']:.3f}")

    def finish(self) -> None:
        """Close the bar and wandb; draw ``metrics.png`` from what was logged."""
        if self._log_redirect is not None:
            self._log_redirect.__exit__(None, None, None)
            self._log_redirect = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
        if self.plot and self.metrics_path.exists() and self.metrics_path.stat().st_size:
            try:
                logger.info("plot: %s", plot_run(self.run_dir))
            except Exception as error:  # a plot must never fail a finished run
                logger.warning("could not draw %s/metrics.png: %s", self.run_dir, error)


def _is_console_handler(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (
        sys.stdout,
        sys.stderr,
    )
