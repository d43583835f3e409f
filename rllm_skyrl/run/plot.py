"""Training curves from a run directory: ``python -m rllm_skyrl.run.plot RUN_DIR [--out PATH]``.

Reads ``RUN_DIR/metrics.jsonl``, written while training, so this also works on a run that is still
going or that died.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rllm_skyrl.run.metrics import KL_KEYS
from rllm_skyrl.run.metrics_file import read_metrics

TIME_KEYS = ("time/step", "time/generate", "time/forward_backward", "time/testing")


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the run's curves into ``out`` (default ``RUN_DIR/metrics.png``), leaving out panels
    whose series never appear; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    keys = {k for r in records for k, v in r.items() if v is not None}
    kl = [k for k in KL_KEYS if k in keys and k != "train/kl"][:1] + [k for k in ("train/kl",) if k in keys]
    panels: list[tuple[str, list[str]]] = [
        ("training reward", [k for k in ("reward/mean",) if k in keys]),
        ("validation pass@1", sorted(k for k in keys if k.startswith("val/") and k.endswith("/pass@1"))),
        (
            "KL (sampler vs trainer; train/kl: policy vs reference)"
            if "train/kl" in kl
            else "KL (sampler vs trainer)",
            kl,
        ),
        ("seconds per step", [k for k in TIME_KEYS if k in keys]),
    ]
    panels = [(title, series) for title, series in panels if series]
    if not panels:
        raise ValueError(f"{run_dir}/metrics.jsonl has none of reward/mean, val/*/pass@1, KL or time/step")

    columns = 2 if len(panels) > 1 else 1
    rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 3.6 * rows), squeeze=False)
    last_step = max(r["step"] for r in records)
    for ax, (title, series) in zip(axes.flat, panels, strict=False):
        for key in series:
            steps, values = _series(records, key)
            long = len(steps) > 30
            marker = None if long else "o"
            smoothed = long and key == "reward/mean"
            if key == "reward/mean":
                std = _series(records, "reward/std")[1]
                if len(std) == len(steps):
                    low = [v - s for v, s in zip(values, std, strict=True)]
                    high = [v + s for v, s in zip(values, std, strict=True)]
                    ax.fill_between(steps, low, high, alpha=0.15, label="± std")
            ax.plot(steps, values, marker=marker, markersize=3, alpha=0.5 if smoothed else 1, label=key)
            if smoothed:
                window = max(5, len(steps) // 20)
                ax.plot(steps, _moving_average(values, window), linewidth=2, label=f"mean of {window} steps")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_xlim(-0.02 * max(last_step, 1), last_step * 1.02 + 0.1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(str(run_dir), fontsize=9)
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "metrics.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rllm_skyrl.run.plot", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    parser.add_argument("--out", help="where to write the PNG (default RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    if not (Path(args.run_dir) / "metrics.jsonl").exists():
        parser.error(f"{args.run_dir} has no metrics.jsonl; give the run directory (rllm.trainer.run_dir)")
    print(plot_run(args.run_dir, args.out))


if __name__ == "__main__":
    main()
