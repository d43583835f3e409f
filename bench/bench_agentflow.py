"""The quickstart's digit task through an AgentFlow (rLLM's model gateway) against a workflow.

Both sides are the same run under rLLM's ``AgentTrainer`` with ``backend="skyrl"`` and the same
settings (``examples/simple_math/train_with_rllm.sh``: 16 prompts x 32 samples, 2 tokens), in fresh
processes one after the other: ``train_with_rllm`` (rLLM's ``SimpleWorkflow`` on the engine) and
``train_agentflow`` (``flow.py``'s AgentFlow + Evaluator through the gateway). Printed per side: the
median step wall time (between consecutive records of ``metrics.jsonl``, after ``--warmup`` steps),
the wall time from the first step's start to the first 10-step mean reward >= 0.8 (or "not
reached"), then the step ratio agentflow / workflow.

    python -m bench.bench_agentflow [--steps 150] [--warmup 2] [OVERRIDE ...]

Hydra overrides after the options go to both sides, e.g. a partly taught start (the distillation
teacher's recipe stopped early, ``python -m examples.distill.teacher DIR 20``) with
``model.name=DIR training.learning_rate=3e-3 training.group_size=16``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench.records import Side, follow

ROOT = Path(__file__).resolve().parent.parent
SIDES = {
    "workflow": "examples/simple_math/train_with_rllm.sh",
    "agentflow": "examples/simple_math/train_agentflow.sh",
}
TARGET = 0.8
WINDOW = 10


def run_side(name: str, steps: int, tmp: Path, timeout: float, overrides: list[str]) -> Side:
    run_dir = tmp / name
    command = [
        "bash",
        SIDES[name],
        f"rllm.trainer.total_batches={steps}",
        "rllm.trainer.test_freq=0",
        "rllm.trainer.val_before_train=false",
        f"hydra.run.dir={run_dir}",
        f"rllm.trainer.run_dir={run_dir}",
        f"training.default_local_dir={run_dir}/ckpt",  # not the example's: another run may hold that
        *overrides,
    ]
    records = run_dir / "metrics.jsonl"
    side = follow(Side(name), command, records, cwd=ROOT, env=dict(os.environ), timeout=timeout)
    if side.exit_code != 0 or not side.records:
        raise SystemExit(f"{name}: exit {side.exit_code} after {len(side.records)} steps; see {side.log}")
    return side


def summary(side: Side, warmup: int) -> tuple[float, float | None]:
    """Median step wall time after ``warmup`` steps; seconds from the first step's start to the first
    ``WINDOW``-step mean reward of ``TARGET`` (None if never)."""
    step = statistics.median(side.step_walls()[warmup:])
    start = side.arrival[0] - side.records[0].get("time/step", 0.0)
    rewards = side.rewards()
    for end in range(WINDOW, len(rewards) + 1):
        if statistics.fmean(rewards[end - WINDOW : end]) >= TARGET:
            return step, side.arrival[end - 1] - start
    return step, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per side")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sides")
    args = parser.parse_args()
    steps = {}
    with tempfile.TemporaryDirectory(prefix="bench_agentflow_") as tmp:
        for name in SIDES:
            side = run_side(name, args.steps, Path(tmp), args.timeout, args.overrides)
            step, to_target = summary(side, args.warmup)
            steps[name] = step
            rewards = side.rewards()
            reached = f"not reached in {len(rewards)} steps" if to_target is None else f"{to_target:.1f} s"
            print(
                f"{name:9s} step {step:.3f} s (median, {args.warmup} warm-up steps left out), reward "
                f"{rewards[0]:.3f} -> {rewards[-1]:.3f}, to {TARGET} ({WINDOW}-step mean): {reached}, "
                f"load {statistics.fmean(side.load):.1f}",
                flush=True,
            )
    print(f"step ratio agentflow / workflow: {steps['agentflow'] / steps['workflow']:.2f}x")


if __name__ == "__main__":
    main()
