"""The quickstart workload under TRL's GRPOTrainer and under this package, one after the other.

Each side runs in its own fresh process on the same machine and appends one JSON record per step
to a file that this script follows as it grows: this package's ``metrics.jsonl`` (the command
``./scripts/train.sh`` runs: ``python -m examples.simple_math.train``), and TRL's records written
by ``bench/trl_grpo.py`` (a ``TrainerCallback``; TRL comes with the ``bench`` extra,
``pip install -e '.[bench]'``, or ``--trl-python`` names another interpreter that has it). Both
train the same tiny model (built once, from the cache) on the same digit task: 16 prompts x 32
samples per step, 2 new tokens, temperature 1, top_p 1, AdamW lr 1e-3, grad clip 1.0, no KL,
token-mean loss (``bench/trl_grpo.py`` lists how each setting maps to TRL).

Printed per side: the 10-step mean reward every 10 steps, the step at which it first reaches 0.8,
the wall time from process start to that step's end, the CPU time the side's processes used up to
then, the start-up time (process start to the first step's start, ``time/startup/
process_to_first_step`` in the first record) and the median step time (wall time between
consecutive records, so weight sync and anything else between steps count); then the ratios
ours / TRL. The load average is sampled with every record: on a shared machine the wall-clock
figures move with it, the CPU-time figures much less.

How many steps a side needs to reach the target depends on its random draws; both sides are
reproducible from their seed (the quickstart seeds every rollout: ``inference.deterministic_sampling``).
``--seeds`` runs both sides once per seed and ends with the steps and wall time to the target seed
by seed and their medians.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.records import Side, follow
from rllm_skyrl.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def require_trl(python: str) -> None:
    """Stop with the install command when ``python`` cannot import TRL."""
    found = subprocess.run([python, "-c", "import trl"], capture_output=True).returncode == 0
    if not found:
        sys.exit(f"error: TRL is not installed for {python}; run: pip install -e '.[bench]'")


def trailing_means(values: list[float], window: int) -> list[float | None]:
    """Mean of the last ``window`` values at each position (None until ``window`` are there)."""
    return [
        statistics.fmean(values[i + 1 - window : i + 1]) if i + 1 >= window else None
        for i in range(len(values))
    ]


def target_index(values: list[float], window: int, target: float) -> int | None:
    for i, mean in enumerate(trailing_means(values, window)):
        if mean is not None and mean >= target:
            return i
    return None


def summarize(side: Side, window: int, target: float) -> dict:
    """The figures the comparison prints, from one side's followed records."""
    out: dict = {"steps": len(side.records), "exit_code": side.exit_code}
    if not side.records:
        return out
    first = side.records[0]
    out["startup_s"] = first.get("time/startup/process_to_first_step")
    out["first_record_s"] = side.arrival[0]
    step_walls = side.step_walls()
    out["step_wall_median_s"] = statistics.median(step_walls) if step_walls else None
    out["step_time_median_s"] = statistics.median(r["time/step"] for r in side.records)
    out["generate_median_s"] = statistics.median(r.get("time/generate", 0.0) for r in side.records)
    index = target_index(side.rewards(), window, target)
    if index is not None:
        out["target_step"] = side.records[index]["step"]
        out["target_wall_s"] = side.arrival[index]
        out["target_cpu_s"] = side.cpu[index]
    if len(side.cpu) > 1:  # from the first record on: start-up excluded
        out["cpu_per_step_s"] = (side.cpu[-1] - side.cpu[0]) / (len(side.cpu) - 1)
    out["load_mean"] = statistics.fmean(side.load)
    out["load_range"] = (min(side.load), max(side.load))
    means = trailing_means(side.rewards(), window)
    every = range(window - 1, len(means), window)
    out["curve"] = {side.records[i]["step"]: round(means[i], 3) for i in every}
    return out


def fmt(value, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}{unit}" if value < 10 else f"{value:.1f}{unit}"
    return f"{value}{unit}"


def report(trl: dict, ours: dict, window: int, target: float) -> None:
    steps = sorted(set(trl.get("curve", {})) | set(ours.get("curve", {})))
    print(f"\n{window}-step mean reward")
    print(f"{'step':>6}{'TRL':>8}{'ours':>8}")
    for step in steps:
        print(f"{step:>6}{fmt(trl.get('curve', {}).get(step)):>8}{fmt(ours.get('curve', {}).get(step)):>8}")
    rows = [
        ("start-up (process -> first step)", "startup_s", "s"),
        ("first step's record", "first_record_s", "s"),
        ("median step wall time", "step_wall_median_s", "s"),
        ("median time/step (in the record)", "step_time_median_s", "s"),
        ("median time/generate", "generate_median_s", "s"),
        (f"step reaching {window}-step mean >= {target}", "target_step", ""),
        (f"wall time to {target} (from process start)", "target_wall_s", "s"),
        (f"CPU time to {target} (process tree)", "target_cpu_s", "s"),
        ("CPU time per step (process tree)", "cpu_per_step_s", "s"),
        ("1-min load average (mean)", "load_mean", ""),
    ]
    print(f"\n{'':<42}{'TRL':>10}{'ours':>10}{'ours/TRL':>10}")
    for label, key, unit in rows:
        a, b = trl.get(key), ours.get(key)
        ratio = f"{b / a:.2f}x" if a and b and key != "load_mean" else ""
        print(f"{label:<42}{fmt(a, unit):>10}{fmt(b, unit):>10}{ratio:>10}")
    for name, side in (("TRL", trl), ("ours", ours)):
        low, high = side.get("load_range", (None, None))
        print(f"{name}: {side['steps']} steps, exit code {side['exit_code']}, load {fmt(low)}..{fmt(high)}")


def side_argv(
    name: str, args: argparse.Namespace, model: Path, out: Path, seed: int | None
) -> tuple[list[str], Path]:
    """The command of one side and the file its records go to.

    A ``seed`` goes to TRL (torch's sampling and its sampler's shuffle) and to this package (the
    shuffle and the trainer seed, from which every rollout request is seeded with
    ``inference.deterministic_sampling``). The task rows are the same on both sides whatever the seed.
    """
    if name == "trl":
        records = out / "trl" / "records.jsonl"
        argv = [
            args.trl_python,
            "-m",
            "bench.trl_grpo",
            "--model",
            str(model),
            "--records",
            str(records),
        ]
        argv += ["--output-dir", str(out / "trl"), "--steps", str(args.steps)]
        if seed is not None:
            argv += ["--seed", str(seed)]
        if args.trl_threads:
            argv += ["--threads", str(args.trl_threads)]
        return argv, records
    run_dir = out / "ours"
    argv = [sys.executable, "-m", "examples.simple_math.train"]
    argv += [
        f"rllm.trainer.total_batches={args.steps}",
        "rllm.trainer.test_freq=0",
        f"hydra.run.dir={run_dir}",
    ]
    if seed is not None:
        argv += [
            f"rllm.data.seed={seed}",
            f"skyrl.trainer.seed={seed}",
            "inference.deterministic_sampling=true",
        ]
    return argv, run_dir / "metrics.jsonl"


def report_seeds(by_seed: dict[int, dict[str, dict]], target: float) -> None:
    """Per seed and over the seeds: steps and wall time to the target, and their ratio."""
    print(
        f"\n{'seed':>6}{'TRL steps':>11}{'ours steps':>12}{'TRL wall':>10}{'ours wall':>11}{'ours/TRL':>10}"
    )
    for seed, sides in by_seed.items():
        trl, ours = sides["trl"], sides["ours"]
        a, b = trl.get("target_wall_s"), ours.get("target_wall_s")
        ratio = f"{b / a:.2f}x" if a and b else None
        print(
            f"{seed:>6}{fmt(trl.get('target_step')):>11}{fmt(ours.get('target_step')):>12}"
            f"{fmt(a, 's'):>10}{fmt(b, 's'):>11}{fmt(ratio):>10}"
        )

    def median(name: str, key: str) -> float | None:
        values = [sides[name][key] for sides in by_seed.values() if key in sides[name]]
        return statistics.median(values) if values else None

    ratios = [
        sides["ours"]["target_wall_s"] / sides["trl"]["target_wall_s"]
        for sides in by_seed.values()
        if "target_wall_s" in sides["ours"] and "target_wall_s" in sides["trl"]
    ]
    print(
        f"medians over {len(by_seed)} seeds: steps to {target} TRL {fmt(median('trl', 'target_step'))}, "
        f"ours {fmt(median('ours', 'target_step'))}; wall TRL {fmt(median('trl', 'target_wall_s'), 's')}, "
        f"ours {fmt(median('ours', 'target_wall_s'), 's')}; ours/TRL per seed: median "
        f"{fmt(statistics.median(ratios) if ratios else None)}, {sum(r <= 1.0 for r in ratios)} of "
        f"{len(ratios)} at most 1.0"
    )
    report_step_gap(by_seed, target)


def report_step_gap(by_seed: dict[int, dict[str, dict]], target: float) -> None:
    """Whether ours learns less per step than TRL: the paired gap in steps to the target, seed by
    seed, and whether it stands out of the seed-to-seed spread (Welch's t over the two samples)."""
    pairs = [
        (sides["trl"]["target_step"], sides["ours"]["target_step"])
        for sides in by_seed.values()
        if sides["trl"].get("target_step") is not None and sides["ours"].get("target_step") is not None
    ]
    if len(pairs) < 2:
        return
    trl, ours = [a for a, _ in pairs], [b for _, b in pairs]
    gaps = [b - a for a, b in pairs]
    spread = (statistics.variance(trl) + statistics.variance(ours)) / len(pairs)
    welch_t = (statistics.mean(ours) - statistics.mean(trl)) / spread**0.5 if spread else math.inf
    print(
        f"steps to {target}, ours - TRL per seed: {gaps}; median gap {statistics.median(gaps):+g} steps; "
        f"TRL {min(trl)}-{max(trl)} (mean {statistics.mean(trl):.1f} +- {statistics.stdev(trl):.1f}), "
        f"ours {min(ours)}-{max(ours)} (mean {statistics.mean(ours):.1f} +- {statistics.stdev(ours):.1f}); "
        f"Welch t {welch_t:.2f} (|t| < 2: the gap is within the seed-to-seed spread)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="steps per side (a cap with --until-target)")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument(
        "--until-target",
        action="store_true",
        help="stop each side once its windowed reward reaches the target (saves time on a loaded machine)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=None,
        help="run both sides once per seed, each reproducible from it, and compare over the seeds "
        "(default: one run each, as configured: seed 0 on both sides)",
    )
    parser.add_argument(
        "--trl-python", default=sys.executable, help="interpreter with trl installed (default: this one)"
    )
    parser.add_argument(
        "--trl-threads", type=int, default=None, help="torch threads for TRL (default: torch's, one per core)"
    )
    parser.add_argument("--sides", nargs="+", choices=("trl", "ours"), default=["trl", "ours"])
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per side")
    parser.add_argument("--out", type=Path, default=None, help="keep logs and records here")
    args = parser.parse_args()
    if "trl" in args.sides:
        require_trl(args.trl_python)

    root_out = args.out or Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    root_out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model()  # both sides load it from the cache
    env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}

    def reached(side: Side) -> bool:
        return target_index(side.rewards(), args.window, args.target) is not None

    follow_args = {"cwd": ROOT, "env": env, "timeout": args.timeout}
    if args.until_target:
        follow_args["stop_when"] = reached
    print(f"model {model}; records and logs in {root_out}; load average {os.getloadavg()}")
    by_seed: dict[int, dict[str, dict]] = {}
    for seed in args.seeds or [None]:
        out = root_out if seed is None else root_out / f"seed{seed}"
        summaries: dict[str, dict] = {name: {"steps": 0, "exit_code": None} for name in ("trl", "ours")}
        for name in args.sides:
            argv, records = side_argv(name, args, model, out, seed)
            records.unlink(missing_ok=True)
            print(f"{name}: {' '.join(argv)}", flush=True)
            side = follow(Side(name), argv, records, **follow_args)
            summaries[name] = summarize(side, args.window, args.target)
            print(
                f"{name}: {len(side.records)} steps, exit code {side.exit_code}, log {side.log}", flush=True
            )
        (out / "summary.json").write_text(json.dumps(summaries, indent=1))
        if seed is not None:
            print(f"\n--- seed {seed}")
            by_seed[seed] = summaries
        report(summaries["trl"], summaries["ours"], args.window, args.target)
    if by_seed:
        report_seeds(by_seed, args.target)


if __name__ == "__main__":
    main()
