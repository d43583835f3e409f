"""One place where metrics leave the process: console, ``metrics.jsonl``, wandb, and plots.

``metrics.jsonl`` in the run directory is always written (one object per logged step:
``{"step": 3, "reward/mean": 0.4, ...}``) because ``plot_run`` and resume read it. The
``console`` logger prints one line per step under a tqdm bar that shows the live reward (log
records are routed through the bar so they do not tear it). The ``wandb`` logger runs offline
unless online mode is asked for (``wandb_mode`` or ``WANDB_MODE``) *and* ``WANDB_API_KEY`` is set.
``finish`` draws ``metrics.png`` (reward, validation pass@1, KL, step time); ``python -m
rllm_skyrl.plot RUN_DIR`` draws it on demand.

Secrets stay out of everything written: config dumps (``config.json``, wandb's config, Hydra's
``.hydra/*.yaml``) have the values of secret-looking keys replaced, and the values of secret
environment variables (``WANDB_API_KEY``, ``HF_TOKEN``, ...) and of secret config keys are masked
in log records (std ``logging`` and loguru), in those dumps, and in the command line wandb records.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

logger = logging.getLogger(__name__)

KNOWN_LOGGERS = ("console", "wandb")
REDACTED = "<redacted>"
_SECRET_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"}


def is_secret_key(name: str) -> bool:
    """True for ``api_key``, ``HF_TOKEN``, ``clientSecret``, ``password``... but not ``max_tokens``
    or ``tokenizer``: the key is split into words and a word must be a secret word exactly."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return any(word in _SECRET_WORDS for word in re.split(r"[^a-zA-Z0-9]+", spaced.lower()))


def redact(value: Any) -> Any:
    """A copy of a nested dict/list config with the values of secret-looking keys replaced."""
    if isinstance(value, Mapping):
        return {k: REDACTED if is_secret_key(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


MIN_SECRET_LENGTH = 6  # shorter values ("true", "1") are not masked wherever they appear


def secret_values(config: Any = None, environ: Mapping[str, str] | None = None) -> set[str]:
    """Values to mask: secret-looking environment variables and secret-looking config keys."""
    environ = os.environ if environ is None else environ
    found = {v for k, v in environ.items() if is_secret_key(k) and len(v) >= MIN_SECRET_LENGTH}

    def walk(value: Any, secret: bool) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, secret or is_secret_key(str(key)))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item, secret)
        elif secret and isinstance(value, str) and len(value) >= MIN_SECRET_LENGTH and value != REDACTED:
            found.add(value)

    walk(config, False)
    return found


class SecretMasker(logging.Filter):
    """Replaces known secret values in text; as a logging filter, in every record it passes."""

    def __init__(self, values: Iterable[str] = ()) -> None:
        super().__init__()
        self.values: set[str] = set()
        self.add(values)

    def add(self, values: Iterable[str]) -> None:
        self.values |= {v for v in values if len(v) >= MIN_SECRET_LENGTH}
        self._ordered = sorted(self.values, key=len, reverse=True)  # longest first: no partial leftovers

    def mask(self, text: str) -> str:
        for value in self._ordered:
            if value in text:
                text = text.replace(value, REDACTED)
        return text

    def mask_tree(self, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: self.mask_tree(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.mask_tree(v) for v in value]
        return self.mask(value) if isinstance(value, str) else value

    def mask_argv(self, argv: Iterable[str]) -> list[str]:
        """``key=value`` arguments with a secret key lose their value; known values are masked."""
        out = []
        for arg in argv:
            key, eq, _ = arg.partition("=")
            out.append(f"{key}={REDACTED}" if eq and is_secret_key(key.split(".")[-1]) else self.mask(arg))
        return out

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._ordered:
            return True
        message = record.getMessage()
        masked = self.mask(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self.mask(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = self.mask(record.exc_text)
        return True


_MASKER = SecretMasker()


def install_secret_masking(values: Iterable[str]) -> SecretMasker:
    """Mask ``values`` in every log record this process emits from now on (logging and loguru)."""
    _MASKER.add(values)
    handlers = list(logging.getLogger().handlers)
    if logging.lastResort is not None:
        handlers.append(logging.lastResort)
    for handler in handlers:
        if _MASKER not in handler.filters:
            handler.addFilter(_MASKER)
    try:
        from loguru import logger as loguru_logger

        def patch(record: dict) -> None:
            record["message"] = _MASKER.mask(record["message"])

        loguru_logger.configure(patcher=patch)
    except ImportError:
        pass
    return _MASKER


def _scrub_hydra_outputs(masker: SecretMasker) -> None:
    """Hydra writes the composed config and the command-line overrides to ``.hydra/*.yaml``."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if not hydra_cfg.output_subdir:
        return
    for path in (Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir).glob("*.yaml"):
        text = path.read_text()
        lines = [_redact_yaml_line(line) for line in masker.mask(text).splitlines(keepends=True)]
        if "".join(lines) != text:
            path.write_text("".join(lines))


_YAML_KEY_VALUE = re.compile(r"^(\s*(?:- )?)([\w.+~-]+)(\s*[:=]\s*)(\S.*?)(\s*)$")


def _redact_yaml_line(line: str) -> str:
    """``api_key: x`` and ``- wandb.api_key=x`` (an override) keep their key, lose their value."""
    match = _YAML_KEY_VALUE.match(line.rstrip("\n"))
    if not match or not is_secret_key(match.group(2).lstrip("+~").split(".")[-1]):
        return line
    if match.group(4) in ("null", "''", '""', "???", "{}", "[]"):
        return line
    newline = "\n" if line.endswith("\n") else ""
    return f"{match.group(1)}{match.group(2)}{match.group(3)}{REDACTED}{newline}"


def _scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float | int | None]:
    """Numeric entries as JSON-safe Python numbers; non-finite floats become None (valid JSON)."""
    out: dict[str, float | int | None] = {}
    for key, value in metrics.items():
        if isinstance(value, bool | np.bool_):
            out[key] = int(value)
        elif isinstance(value, int | np.integer):
            out[key] = int(value)
        elif isinstance(value, float | np.floating):
            out[key] = float(value) if math.isfinite(value) else None
    return out


def _first_key(metrics: Mapping[str, Any], candidates: Iterable[str]) -> str | None:
    return next((k for k in candidates if metrics.get(k) is not None), None)


KL_KEYS = ("train/kl", "train/kl_sample_train_v1", "train/kl_sample_train_v2", "policy/kl")


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
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.plot = plot
        config = dict(config or {})
        self.masker = install_secret_masking(secret_values(config))
        safe_config = self.masker.mask_tree(redact(config))
        (self.run_dir / "config.json").write_text(json.dumps(safe_config, indent=2, default=str))
        _scrub_hydra_outputs(self.masker)
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
        if self.metrics_path.exists():
            keep_through = resume_step if resume_step > 0 else -1  # a fresh run keeps nothing
            lines = [line for line in self.metrics_path.read_text().splitlines() if line.strip()]
            kept = [line for line in lines if json.loads(line)["step"] <= keep_through]
            self.metrics_path.write_text("".join(f"{line}\n" for line in kept))
        if "console" in self.loggers:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(
                total=total_steps, initial=resume_step, desc="training", unit="step", dynamic_ncols=True
            )
            if any(_is_console_handler(h) for h in logging.getLogger().handlers):
                self._log_redirect = logging_redirect_tqdm()  # log lines above the bar, not through it
                self._log_redirect.__enter__()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        record = _scalar_metrics(metrics)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, **record}) + "\n")
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


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw reward, val pass@1, KL and step-time curves into ``metrics.png`` (see ``rllm_skyrl.plot``)."""
    from rllm_skyrl.plot import plot_run as draw

    return draw(run_dir, out)
