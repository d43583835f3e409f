"""What each CPU speed patch set buys the quickstart: runs with it turned off against runs with all on.

Each run is ``python -m examples.simple_math.train`` for ``--steps`` steps, a fresh process, with
``RLLM_SKYRL_COMPAT_DISABLE`` naming the set turned off (none for the baseline). Runs alternate
between the variants, round after round, so a slower hour hits every variant alike; the medians of
each variant's start-up (``time/startup/process_to_first_step``) and step time (``time/step``,
generation through the optimizer step, over the steps after the first) are printed with their
ratio to the baseline's. At the SmolLM2 shape, where a step takes a minute, compare
``python -m bench.bench_step --shape smollm2`` with and without
``RLLM_SKYRL_COMPAT_DISABLE=response_logits`` instead.

    python -m bench.bench_patches [--sets lazy_imports registries ...] [--rounds 5] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rllm_skyrl import compat

ROOT = Path(__file__).resolve().parent.parent
SPEED_SETS = [p.name for p in compat.PATCH_SETS if p.purpose == compat.SPEED]


def one_run(disabled: str, steps: int, out: Path) -> tuple[float, float]:
    """Start-up and median step time of one quickstart run with ``disabled`` turned off."""
    run_dir = out / f"{disabled or 'all'}-{len(list(out.iterdir()))}"
    env = {**os.environ, compat.DISABLE_VAR: disabled, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "examples.simple_math.train",
        f"rllm.trainer.total_batches={steps}",
        "rllm.trainer.test_freq=0",
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"run with {disabled or 'every set'} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    startup = records[0]["time/startup/process_to_first_step"]
    return startup, statistics.median(r["time/step"] for r in records[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", nargs="+", default=SPEED_SETS, choices=SPEED_SETS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench_patches_"))
    variants = ["", *args.sets]
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for round_index in range(args.rounds):
        for variant in variants:
            startup, step = one_run(variant, args.steps, out)
            results[variant].append((startup, step))
            print(
                f"round {round_index + 1}: {variant or 'all sets':28s} start-up {startup:6.2f} s  "
                f"step {step:.4f} s  load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    base_startup = statistics.median(s for s, _ in results[""])
    base_step = statistics.median(s for _, s in results[""])
    print(f"\nmedians of {args.rounds} rounds, {args.steps} steps each (ratio: without the set / all sets)")
    print(f"{'all sets':28s} start-up {base_startup:6.2f} s          step {base_step:.4f} s")
    for variant in args.sets:
        startup = statistics.median(s for s, _ in results[variant])
        step = statistics.median(s for _, s in results[variant])
        print(
            f"without {variant:20s} start-up {startup:6.2f} s ({startup / base_startup:.2f}x)  "
            f"step {step:.4f} s ({step / base_step:.2f}x)"
        )


if __name__ == "__main__":
    main()
