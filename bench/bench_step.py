"""Where a training step's time goes, against the bare compute it wraps, measured in one run.

Runs the simple_math GRPO example for a few steps through the whole stack (SkyRL workers on Ray,
the inference server over HTTP, weight sync), then times the same work in plain torch in this
process: ``model.generate`` for the rollouts and one forward/backward/AdamW step on the same
sequences. Prints the per-stage breakdown and the ratio stack / bare.

    python -m bench.bench_step [--steps 20] [--warmup 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from examples.simple_math.task import make_rows, reward_fn
from rllm_skyrl import launcher
from rllm_skyrl.run_log import read_metrics
from rllm_skyrl.standalone.workflow import SingleTurnWorkflow
from rllm_skyrl.tiny_model import build_tiny_model

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "simple_math"
STAGES = ("generate", "transform", "forward_backward", "optim_step", "weight_sync", "save_checkpoint")


def stack_breakdown(steps: int, warmup: int, out: Path) -> tuple[dict[str, float], dict]:
    with initialize_config_dir(config_dir=str(EXAMPLE), version_base=None):
        cfg = compose(
            "config",
            overrides=[
                f"rllm.trainer.total_batches={steps + warmup}",
                "rllm.trainer.test_freq=0",
                f"training.default_local_dir={out}/ckpt",
                f"rllm.trainer.run_dir={out}/run",
            ],
        )
    run_dir = launcher.run(
        cfg,
        workflow_class=SingleTurnWorkflow,
        workflow_args={"reward_fn": reward_fn},
        train_dataset=make_rows(cfg.dataset.train_rows, seed=cfg.dataset.seed),
    )
    records = [r for r in read_metrics(run_dir) if r["step"] > warmup]
    times = {stage: statistics.mean(r.get(f"time/{stage}", 0.0) for r in records) for stage in STAGES}
    times["step"] = statistics.mean(r["time/step"] for r in records)
    return times, cfg


def bare_compute(cfg, repeats: int) -> dict[str, float]:
    """The same rollouts and update in plain torch: no Ray, no HTTP, no FSDP, no weight sync."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    rows = make_rows(cfg.rllm.data.train_batch_size, seed=1)
    chats = [
        [{"role": "user", "content": r["question"]}] for r in rows for _ in range(cfg.training.group_size)
    ]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    new_tokens = cfg.rllm.data.max_response_length
    generate, update = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            sequences = model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                pad_token_id=tokenizer.pad_token_id,
            )
        generate.append(time.perf_counter() - start)
        start = time.perf_counter()
        attention = (sequences != tokenizer.pad_token_id).long()
        logits = model(sequences, attention_mask=attention).logits[:, -new_tokens - 1 : -1]
        logprobs = torch.log_softmax(logits, -1).gather(-1, sequences[:, -new_tokens:, None]).squeeze(-1)
        advantages = torch.randn(logprobs.shape[0], 1)
        loss = -(advantages * logprobs).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        update.append(time.perf_counter() - start)
    return {"generate": statistics.median(generate), "update": statistics.median(update)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        stack, cfg = stack_breakdown(args.steps, args.warmup, Path(scratch))
    bare = bare_compute(cfg, repeats=args.steps)
    bare_step = bare["generate"] + bare["update"]
    batch = cfg.rllm.data.train_batch_size * cfg.training.group_size
    tokens = cfg.rllm.data.max_response_length
    print(f"\nstep of {batch} rollouts x {tokens} tokens, mean over {args.steps} steps")
    print(f"{'stage':<18}{'stack s':>10}{'share':>8}")
    for stage in STAGES:
        print(f"{stage:<18}{stack[stage]:>10.3f}{stack[stage] / stack['step']:>8.0%}")
    other = stack["step"] - sum(stack[s] for s in STAGES)
    print(f"{'other (driver)':<18}{other:>10.3f}{other / stack['step']:>8.0%}")
    print(f"{'step':<18}{stack['step']:>10.3f}")
    print(f"\nbare torch: generate {bare['generate']:.3f} s + update {bare['update']:.3f} s")
    print(f"bare step: {bare_step:.3f} s")
    print(f"generate ratio (stack/bare): {stack['generate'] / bare['generate']:.2f}x")
    update = stack["forward_backward"] + stack["optim_step"]
    print(f"update ratio (stack/bare):   {update / bare['update']:.2f}x")
    print(f"step ratio (stack/bare):     {stack['step'] / bare_step:.2f}x")


if __name__ == "__main__":
    main()
