"""The quickstart workload under TRL's ``GRPOTrainer``: the baseline side of ``bench_vs_trl``.

Runs in its own process (TRL comes with the ``bench`` extra: ``pip install -e '.[bench]'``) and
appends one JSON record per optimizer step to ``--records``, the way this package's ``metrics.jsonl``
grows: ``step``, ``reward/mean``, ``time/step`` (step begin to step end),
``time/generate`` (sampling and scoring, inside the step) and ``wall`` (``time.time()`` at the
step's end). The first record also carries ``time/startup/process_to_first_step``, measured like
the package's own: from this process's creation to the first step's start.

How each setting maps onto TRL (``bench_vs_trl --help`` and the README list the differences):

- 16 prompts x 32 samples per step: ``per_device_train_batch_size=512`` (TRL counts completions,
  not prompts), ``num_generations=32``, ``gradient_accumulation_steps=1`` and
  ``steps_per_generation=1``, so one TRL step = one generation = one optimizer step.
- 2 new tokens, temperature 1, top_p 1, no top-k: ``max_completion_length=2``, ``temperature=1``,
  ``top_p=1``, ``top_k=0``.
- AdamW lr 1e-3, betas (0.9, 0.999), no weight decay, constant schedule, no warmup, clip 1.0:
  ``optim="adamw_torch"``, ``lr_scheduler_type="constant"``, ``max_grad_norm=1.0``.
- No KL: ``beta=0`` (TRL then loads no reference model); one update per batch:
  ``num_iterations=1`` (the PPO ratio is 1, so the clip ``epsilon=0.2`` never binds).
- Token-mean loss over the whole batch: ``loss_type="dapo"`` (normalised by the active tokens of
  the global batch, the package's ``token_mean``).
- Group-normalised advantages: ``scale_rewards="group"``: (r - mean) / (std + 1e-4), std with
  Bessel's correction; the package uses the population std and 1e-6 (a 1.6 % larger scale at
  32 samples, well inside the run-to-run noise).
- fp32, no gradient checkpointing (TRL's defaults are bf16 and checkpointing on), CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from examples.simple_math.task import make_rows, reward_fn
from rllm_skyrl.run.process_clock import process_started_at


def digit_reward(completions: list, answer: list[str], **_) -> list[float]:
    """The task's own reward on each completion's text (TRL hands conversational completions)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [reward_fn({"answer": a}, text) for a, text in zip(answer, texts, strict=True)]


class StepRecords(TrainerCallback):
    """One record per optimizer step with wall-clock times, appended as steps finish."""

    def __init__(self, path: Path, timer: dict[str, float]) -> None:
        self.path = path
        self.timer = timer
        self.begin = 0.0
        self.end = 0.0
        self.created = process_started_at()

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin = time.time()
        if state.global_step == 0:
            self.first_begin = self.begin

    def on_step_end(self, args, state, control, **kwargs):
        self.end = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        record = {
            "step": state.global_step,
            "reward/mean": logs["reward"],
            "time/step": self.end - self.begin,
            "time/generate": self.timer.pop("generate", 0.0),
            "wall": self.end,
        }
        if state.global_step == 1:
            record["time/startup/process_to_first_step"] = self.first_begin - self.created
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def timed_generation(trainer: GRPOTrainer, timer: dict[str, float]) -> None:
    """Time TRL's sampling and scoring of a batch, which runs inside its training step."""
    generate = trainer._generate_and_score_completions

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            timer["generate"] = timer.get("generate", 0.0) + time.perf_counter() - start

    trainer._generate_and_score_completions = wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="tiny model directory (rllm_skyrl.tiny_model)")
    parser.add_argument("--records", required=True, type=Path, help="JSONL file to append step records to")
    parser.add_argument("--output-dir", required=True, help="TRL's output_dir (nothing is saved)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = make_rows(4096, seed=0)  # examples/simple_math/config.yaml: dataset.train_rows, dataset.seed
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows]
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.samples,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.samples,
        num_iterations=1,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=args.lr,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    timer: dict[str, float] = {}
    args.records.parent.mkdir(parents=True, exist_ok=True)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepRecords(args.records, timer)],
    )
    timed_generation(trainer, timer)
    trainer.train()


if __name__ == "__main__":
    main()
