"""One place where metrics leave the process: console, ``metrics.jsonl``, wandb, and plots.

``metrics.jsonl`` in the run directory is always written (one object per logged step:
``{"step": 3, "reward/mean": 0.4, ...}``) because ``plot_run`` and resume read it. The
``console`` logger prints one line per step under a tqdm bar that shows the live reward. The
``wandb`` logger runs offline unless online mode is asked for (``wandb_mode`` or ``WANDB_MODE``)
*and* ``WANDB_API_KEY`` is set. Config dumps (``config.json``, wandb's config) are redacted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

logger = logging.getLogger(__name__)

KNOWN_LOGGERS = ("console", "wandb")
REDACTED = "<redacted>"
_SECRET_WORDS = {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials"}


def _is_secret_key(name: str) -> bool:
    """True for ``api_key``, ``HF_TOKEN``, ``clientSecret``, ``password``... but not ``max_tokens``
    or ``tokenizer``: the key is split into words and a word must be a secret word exactly."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return any(word in _SECRET_WORDS for word in re.split(r"[^a-zA-Z0-9]+", spaced.lower()))


def redact(value: Any) -> Any:
    """A copy of a nested dict/list config with the values of secret-looking keys replaced."""
    if isinstance(value, Mapping):
        return {k: REDACTED if _is_secret_key(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


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
    ) -> None:
        self.loggers = list(loggers)
        unknown = sorted(set(self.loggers) - set(KNOWN_LOGGERS))
        if unknown:
            raise ValueError(f"unknown logger(s) {unknown}; choose from {list(KNOWN_LOGGERS)}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        safe_config = redact(dict(config or {}))
        (self.run_dir / "config.json").write_text(json.dumps(safe_config, indent=2, default=str))
        self.total_steps: int | None = None
        self._bar: tqdm | None = None
        self._wandb_run = None
        if "wandb" in self.loggers:
            import wandb

            self._wandb_run = wandb.init(
                project=project_name,
                name=experiment_name,
                dir=str(self.run_dir),
                mode=_wandb_mode(wandb_mode),
                config=safe_config,
            )

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
            self._bar = tqdm(
                total=total_steps, initial=resume_step, desc="training", unit="step", dynamic_ncols=True
            )

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
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path) -> Path:
    """Draw reward, val pass@1, KL and step-time curves from ``metrics.jsonl`` into ``metrics.png``.

    Panels whose series never appear are left out; a run with none of them is an error.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    keys = {k for r in records for k, v in r.items() if v is not None}
    panels: list[tuple[str, list[str]]] = [
        ("reward", [k for k in ("reward/mean",) if k in keys]),
        ("val pass@1", sorted(k for k in keys if k.startswith("val/") and k.endswith("/pass@1"))),
        ("KL", [k for k in KL_KEYS if k in keys][:1]),
        ("step time (s)", [k for k in ("time/step",) if k in keys]),
    ]
    panels = [(title, series) for title, series in panels if series]
    if not panels:
        raise ValueError(f"{run_dir}/metrics.jsonl has none of reward/mean, val/*/pass@1, KL or time/step")
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, series) in zip(axes[:, 0], panels, strict=True):
        for key in series:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(series) > 1 or title == "val pass@1":
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = Path(run_dir) / "metrics.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
