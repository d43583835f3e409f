"""SFT on the addition task through ``ModelRegistry``: ``python -m examples.sft.train [overrides]``.

Writes the generated pairs as parquet, trains with ``cross_entropy`` on SkyRL's workers, prints the
held-out loss every ``sft.eval_every`` steps, and exports an HF model directory (``sft.export_dir``)
that an RL run takes as ``model.path``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from omegaconf import DictConfig

from examples.sft.task import read_sft_parquet, split_pairs, write_sft_parquet
from rllm_skyrl import compat
from rllm_skyrl.compat.output_masking import mask_process_output
from rllm_skyrl.data.adapter import sft_examples_to_batch
from rllm_skyrl.run.exits import clean_stop, one_line_errors
from rllm_skyrl.run_config import resolve_run_config
from rllm_skyrl.runtime import Runtime

MODEL_ID = "sft"


@dataclass
class SFTResult:
    export_dir: Path
    heldout_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    seconds: float = 0.0


def encode(tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """Prompt as the rollout engine renders it (chat template, generation prompt); response + EOS."""
    examples = []
    for prompt, response in pairs:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        response_ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append((prompt_ids, response_ids))
    return examples


def shuffled_batches(examples: list, batch_size: int, seed: int) -> Iterator[list]:
    """Endless epochs over ``examples`` in a new order each time; a batch never spans two epochs."""
    rng = random.Random(seed)
    while True:
        order = list(examples)
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


def train_sft(cfg: DictConfig) -> SFTResult:
    """Run the SFT loop described by ``cfg`` (this example's config) and export the model."""
    started = time.perf_counter()
    sft = cfg.sft
    train_pairs, heldout_pairs = split_pairs(sft.heldout_pairs, seed=sft.seed)
    data_dir = Path(sft.data_dir)
    train_path = write_sft_parquet(data_dir / "train.parquet", train_pairs)
    heldout_path = write_sft_parquet(data_dir / "heldout.parquet", heldout_pairs)

    # One optimizer step per SFT step: the run is exactly sft.steps optimizer steps long.
    with one_line_errors():
        run = resolve_run_config(cfg).for_total_steps(sft.steps)
    runtime = Runtime.start(run, serve=False)
    try:
        tokenizer, models = runtime.tokenizer, runtime.models
        train = encode(tokenizer, read_sft_parquet(train_path))
        heldout = encode(tokenizer, read_sft_parquet(heldout_path))
        print(f"data: {len(train)} train pairs ({train_path}), {len(heldout)} held-out ({heldout_path})")
        models.create_model(MODEL_ID)
        dp_size = runtime.workers.dp_size("policy")

        def batch_of(examples: list):
            return sft_examples_to_batch(examples, pad_token_id=tokenizer.pad_token_id, dp_size=dp_size)

        heldout_batch = batch_of(heldout)
        result = SFTResult(export_dir=Path(sft.export_dir))

        def evaluate(step: int, train_loss: float | None) -> None:
            loss = models.forward(MODEL_ID, heldout_batch, loss_fn="cross_entropy").metrics["loss"]
            result.heldout_losses.append((step, loss))
            shown = "" if train_loss is None else f"train loss {train_loss:.3f}  "
            print(f"step {step:4d}  {shown}held-out loss {loss:.3f}", flush=True)

        evaluate(0, None)
        batches = shuffled_batches(train, sft.batch_size, seed=sft.seed)
        for step in range(1, sft.steps + 1):
            output = models.forward_backward(MODEL_ID, batch_of(next(batches)), loss_fn="cross_entropy")
            models.optim_step(MODEL_ID)
            if step % sft.eval_every == 0 or step == sft.steps:
                evaluate(step, output.metrics["loss"])
        models.save_hf_model(MODEL_ID, str(result.export_dir))
    finally:
        runtime.shutdown()
    result.seconds = time.perf_counter() - started
    first, last = result.heldout_losses[0][1], result.heldout_losses[-1][1]
    print(f"held-out loss: {first:.3f} -> {last:.3f} in {sft.steps} steps ({result.seconds:.0f} s)")
    print(f"HF model: {result.export_dir}")
    rl_command = "python -m examples.sft.rl_addition training.learning_rate=3e-4"
    print(f"RL from it: {rl_command} model.path={result.export_dir}")
    return result


@hydra.main(config_path=".", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    mask_process_output()
    compat.apply(["quiet_logs"])
    with clean_stop():
        train_sft(cfg)


if __name__ == "__main__":
    main()
