"""What only a GPU can show, in one command (``scripts/gpu_check.sh`` installs the gpu extra first).

Short GRPO runs of ``examples/simple_math`` through SkyRL's vLLM servers and weight transfer:

  quickstart  tiny model, 30 steps: reward, step time and the trainer-vs-vLLM logprob gap per step
  colocated   the same with trainer and vLLM sharing one GPU (CUDA IPC weight transfer)
  smollm2     SmolLM2-135M, whose embeddings are tied, 8 steps at a high learning rate: the gap once
              trained weights have reached vLLM says whether lm_head stayed tied

On one GPU only the colocated placement fits (separate placement needs a GPU for the trainer and
one for vLLM), so the quickstart and smollm2 run colocated and the separate placement is reported
as not checked. Ends with one table; exits 1 when a gap is over its bound, the tiny model did not
learn, or a run failed. Without CUDA it says so and exits 0.

    python -m bench.gpu_check [--workdir DIR]

The gap bound: vLLM computes in bf16 (SkyRL's ``model_dtype``), the trainer in fp32 (this
backend's default). bf16 keeps 8 significant bits, a relative rounding of 2**-9 (0.2%) per value;
logits of magnitude ~10 then carry ~0.02 of rounding, and a sampled token's log-probability
inherits errors of that order, so the mean |logprob difference| per step is expected at ~0.01-0.02.
``GAP_BOUND`` = 0.05 leaves room for that and still fails on real mismatches (stale or partial
weights, an untied head), which show as 0.1 and more and grow with training (``GAP_DRIFT``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GAP_BOUND = 0.05  # mean |rollout logprob - trainer logprob| per step (bf16 vLLM vs fp32 trainer)
GAP_DRIFT = 0.02  # allowed rise of that gap from step 1 (same checkpoint) to after weight syncs
LEARNING_GAIN = 0.02  # tiny model: reward of the last 5 steps over the first 5 (on CPU: 0.004 -> 0.10)
LOG_TAIL = 40

GAP = "train/logprob_abs_diff/mean"
COMMON = (
    "rllm.trainer.test_freq=0",
    "++skyrl.generator.inference_engine.enforce_eager=true",  # no compile/graph capture: starts faster
)
TINY = ("model.path=tiny", "training.learning_rate=5e-3", "rllm.trainer.total_batches=30")
SMOLLM2 = (
    "model.path=smollm2",
    "training.learning_rate=1e-4",  # high on purpose: weights must move for an untied head to show
    "rllm.trainer.total_batches=8",
    "rllm.data.train_batch_size=16",
    "training.group_size=8",
    "rllm.data.max_response_length=16",
    "skyrl.trainer.micro_train_batch_size_per_gpu=16",
    "skyrl.trainer.micro_forward_batch_size_per_gpu=16",
)
# Colocated: vLLM stays awake while the trainer trains beside it, so it takes less of the GPU.
COLOCATED = (
    "skyrl.trainer.placement.colocate_all=true",
    "++skyrl.generator.inference_engine.gpu_memory_utilization=0.4",
)


@dataclass(frozen=True)
class Case:
    """One training run: its overrides, how many GPUs it is given, and whether it must learn."""

    name: str
    overrides: tuple[str, ...]
    gpus: int
    must_learn: bool = False


@dataclass
class Result:
    """What a run showed; ``problems`` is empty when it passed."""

    name: str
    placement: str
    steps: int = 0
    reward_first: float = float("nan")
    reward_last: float = float("nan")
    step_seconds: float = float("nan")
    gap_start: float = float("nan")
    gap_trained: float = float("nan")
    sync_seconds: float = float("nan")
    problems: list[str] = field(default_factory=list)


def plan_cases(num_gpus: int) -> tuple[list[Case], list[str]]:
    """The runs this machine can do, and what it cannot check (said plainly in the summary)."""
    if num_gpus >= 2:
        cases = [
            Case("quickstart", TINY, gpus=2, must_learn=True),
            Case("colocated", TINY + COLOCATED, gpus=1, must_learn=True),
            Case("smollm2", SMOLLM2, gpus=2),
        ]
        return cases, []
    cases = [
        Case("quickstart", TINY + COLOCATED, gpus=1, must_learn=True),
        Case("smollm2", SMOLLM2 + COLOCATED, gpus=1),
    ]
    skipped = [
        "separate placement (trainer and vLLM on their own GPUs, NCCL weight broadcast) needs 2 GPUs; "
        "this machine has 1, so the quickstart ran colocated and the separate path was not checked"
    ]
    return cases, skipped


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize(name: str, placement: str, records: list[dict], must_learn: bool) -> Result:
    """Reduce a run's metrics to the table's numbers and judge them against the bounds."""
    steps = [r for r in records if "reward/mean" in r]
    result = Result(name, placement, steps=len(steps))
    if not steps:
        result.problems.append("no training step was logged")
        return result
    rewards = [r["reward/mean"] for r in steps]
    gaps = [r[GAP] for r in steps if r.get(GAP) is not None]
    result.reward_first, result.reward_last = _mean(rewards[:5]), _mean(rewards[-5:])
    result.step_seconds = statistics.median(r["time/step"] for r in steps if "time/step" in r)
    syncs = [r["time/weight_sync"] for r in steps if r.get("time/weight_sync") is not None]
    result.sync_seconds = statistics.median(syncs) if syncs else float("nan")
    if not gaps:
        result.problems.append(f"no {GAP} logged: rollout logprobs missing")
        return result
    result.gap_start, result.gap_trained = gaps[0], _mean(gaps[1:])
    if result.gap_start > GAP_BOUND:
        result.problems.append(f"logprob gap at step 1 {result.gap_start:.3f} > {GAP_BOUND} (same weights)")
    if len(gaps) > 1 and result.gap_trained > GAP_BOUND:
        result.problems.append(f"logprob gap after weight syncs {result.gap_trained:.3f} > {GAP_BOUND}")
    if len(gaps) > 1 and result.gap_trained > result.gap_start + GAP_DRIFT:
        result.problems.append(
            f"logprob gap grew from {result.gap_start:.3f} to {result.gap_trained:.3f} after weight syncs "
            "(served weights differ from the trainer's)"
        )
    if must_learn and result.reward_last - result.reward_first < LEARNING_GAIN:
        result.problems.append(
            f"reward {result.reward_first:.3f} -> {result.reward_last:.3f}: "
            f"less than +{LEARNING_GAIN} over {len(steps)} steps"
        )
    return result


def step_lines(records: list[dict]) -> str:
    """The per-step view of one run: reward, step time, logprob gap, KL estimate, weight-sync time."""
    lines = [f"{'step':>5} {'reward':>7} {'s/step':>7} {'|dlogp|':>8} {'kl_v1':>10} {'sync s':>7}"]
    for r in (r for r in records if "reward/mean" in r):
        lines.append(
            f"{r['step']:>5} {r['reward/mean']:>7.3f} {r.get('time/step', float('nan')):>7.2f} "
            f"{r.get(GAP, float('nan')):>8.4f} {r.get('train/kl_sample_train_v1', float('nan')):>10.2e} "
            f"{r.get('time/weight_sync', float('nan')):>7.3f}"
        )
    return "\n".join(lines)


def table(results: list[Result], skipped: list[str]) -> str:
    """One summary table, then what was not checked, then the verdict."""
    header = (
        f"{'run':<11} {'placement':<10} {'steps':>5} {'reward first5->last5':>21} {'s/step':>7} "
        f"{'gap step1':>9} {'gap synced':>10} {'sync s':>7}  result"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        rewards = f"{r.reward_first:.3f} -> {r.reward_last:.3f}"
        lines.append(
            f"{r.name:<11} {r.placement:<10} {r.steps:>5} {rewards:>21} {r.step_seconds:>7.2f} "
            f"{r.gap_start:>9.4f} {r.gap_trained:>10.4f} {r.sync_seconds:>7.3f}  "
            + ("ok" if not r.problems else "FAIL")
        )
    lines.append(
        f"bounds: gap <= {GAP_BOUND} (bf16 vLLM vs fp32 trainer), rise <= {GAP_DRIFT}; "
        f"quickstart reward gain >= {LEARNING_GAIN}"
    )
    lines += [f"{r.name}: {problem}" for r in results for problem in r.problems]
    lines += [f"not checked: {note}" for note in skipped]
    failed = any(r.problems for r in results)
    lines.append("GPU check FAILED" if failed else "GPU check passed")
    return "\n".join(lines)


def cuda_devices() -> int:
    """GPUs torch can use here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def driver_gpus() -> list[str]:
    """GPUs the NVIDIA driver lists (``nvidia-smi -L``), whether or not torch can use them."""
    if shutil.which("nvidia-smi") is None:
        return []
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return [line for line in listing.stdout.splitlines() if line.startswith("GPU ")]


def run_case(case: Case, workdir: Path) -> tuple[Result, list[dict]]:
    """Train ``case`` in a subprocess on its first ``case.gpus`` GPUs; summarize its metrics."""
    from rllm_skyrl.run.metrics_file import read_metrics

    run_dir = workdir / case.name
    log_file = workdir / f"{case.name}.log"
    placement = "colocated" if any("colocate_all=true" in o for o in case.overrides) else "separate"
    command = [sys.executable, "-m", "examples.simple_math.train", *COMMON, *case.overrides]
    command.append(f"hydra.run.dir={run_dir}")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(case.gpus)))}
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # keep the user's choice, narrowed to what the case uses
        env["CUDA_VISIBLE_DEVICES"] = ",".join(os.environ["CUDA_VISIBLE_DEVICES"].split(",")[: case.gpus])
    print(f"\n== {case.name} ({placement}, {case.gpus} GPU(s)); log: {log_file}", flush=True)
    with open(log_file, "w") as log:
        finished = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    result = summarize(case.name, placement, records, case.must_learn)
    if finished.returncode != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-LOG_TAIL:])
        result.problems.insert(0, f"exited with code {finished.returncode}; log tail:\n{tail}")
    return result, records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=None, help="where runs and logs go (default: a temp dir)")
    args = parser.parse_args(argv)
    num_gpus = cuda_devices()
    if num_gpus == 0:
        listed = driver_gpus()
        if listed:  # a GPU torch cannot use is a broken set-up, not a machine without a GPU
            import torch

            print(
                f"nvidia-smi lists {len(listed)} GPU(s) but torch {torch.__version__} (CUDA "
                f"{torch.version.cuda}) cannot use them; the PyPI torch wheel needs an NVIDIA driver "
                "that supports its CUDA version (CUDA 13: driver 580 or newer)."
            )
            return 1
        print(
            "No CUDA GPU here (torch.cuda.is_available() is False): nothing to check. "
            "Run this on a machine with an NVIDIA GPU."
        )
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rllm_skyrl_gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    cases, skipped = plan_cases(num_gpus)
    print(f"{num_gpus} GPU(s); runs: {', '.join(c.name for c in cases)}; work dir: {workdir}")
    results = []
    for case in cases:
        result, records = run_case(case, workdir)
        if records:
            print(step_lines(records), flush=True)
        results.append(result)
    print("\n" + table(results, skipped))
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
