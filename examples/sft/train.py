"""SFT on the successor task through rLLM's ``AgentSFTTrainer(spec, backend="skyrl")``.

``python -m examples.sft.train OUT_DIR [--epochs N] [--lr LR] [--lora-rank R]`` writes the train
and held-out rows, fine-tunes the tiny model on SkyRL's SFT trainer (checkpoints, validation loss on
the held-out rows, ``metrics.jsonl`` in OUT_DIR), and prints the HF model directory an RL run takes
as ``model.path`` (``examples/sft/rl.py``). Run it again with more epochs and it resumes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from examples.sft.task import messages_rows, split

# What the measured run used (README): 100 steps of 10 rows, validation every 25.
DEFAULTS = {
    "model": "tiny",
    "lr": 3e-3,
    "epochs": 20,
    "batch_size": 10,
    "max_length": 64,
    # The RL run's servers render prompts with the tokenizer's chat template: train on that rendering.
    "tokenize_method": "hf_template",
    "lora_rank": 0,
    "save_freq": 50,
    "val_freq": 25,
    "project": "rllm-skyrl-examples",
    "experiment": "sft_successor",
}


def sft_spec(output_dir: str | Path, **fields: Any):
    """rLLM's ``SFTSpec`` for the successor task; ``fields`` override ``DEFAULTS``."""
    from rllm.data import Dataset
    from rllm.trainer.sft import SFTSpec

    train, heldout = split()
    return SFTSpec(
        train_dataset=Dataset(messages_rows(train)),
        val_dataset=Dataset(messages_rows(heldout)),
        output_dir=str(output_dir),
        **{**DEFAULTS, **fields},
    )


def train_sft(output_dir: str | Path, **fields: Any):
    """One SFT run; returns the backend (``model_dir``, ``checkpoint_dir``)."""
    from rllm.trainer.agent_sft_trainer import AgentSFTTrainer

    from rllm_skyrl.rllm_plugin import register

    register()
    trainer = AgentSFTTrainer(sft_spec(output_dir, **fields), backend="skyrl")
    trainer.train()
    return trainer.prepare()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.sft.train")
    parser.add_argument("output_dir")
    parser.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--lora-rank", type=int, default=DEFAULTS["lora_rank"])
    args = parser.parse_args()
    backend = train_sft(args.output_dir, epochs=args.epochs, lr=args.lr, lora_rank=args.lora_rank)
    print(f"HF model: {backend.model_dir}")


if __name__ == "__main__":
    main()
