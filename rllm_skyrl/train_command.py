"""``rllm-skyrl train``: rLLM's ``rllm train`` flags, training an AgentFlow with backend skyrl.

The flags keep rLLM's names and defaults (``rllm/cli/train.py``); the agent and evaluator names
resolve through rLLM's own loaders (registry names, installed plug-ins' entry points, or
``module:object`` paths); datasets come from rLLM's ``DatasetRegistry``. rLLM's flags this command
does not serve are refused by name before anything loads.
"""

from __future__ import annotations

import argparse
from typing import Any

from rllm_skyrl.errors import UserFacingError

# rLLM's `rllm train` flags without a meaning here yet: sandboxes, its UI, sampling set per call
# (the run's rllm.rollout sampling applies), a --config merged onto tinker's templates.
UNSUPPORTED = (
    "--config",
    "--ui",
    "--no-ui",
    "--sandbox-backend",
    "--sandbox-concurrency",
    "--sampling-params",
    "--temperature",
    "--top-p",
    "--max-tokens",
)


SUMMARY = "rLLM's `rllm train` with backend skyrl: train an AgentFlow on a registered dataset"


def build_parser() -> argparse.ArgumentParser:
    """A parser of its own: Hydra overrides may stand among the flags (parse_intermixed_args),
    which argparse does not do for a subcommand."""
    parser = argparse.ArgumentParser(
        prog="rllm-skyrl train",
        description=f"{SUMMARY}. Not supported (refused by name): {', '.join(UNSUPPORTED)}.",
    )
    parser.add_argument("benchmark", help="dataset name in rLLM's DatasetRegistry")
    parser.add_argument("--train-dataset", help="training dataset name (default: <benchmark>)")
    parser.add_argument("--train-split", default="train", help="training split (default: train)")
    parser.add_argument("--val-dataset", help="validation dataset name (default: <benchmark>)")
    parser.add_argument("--val-split", default="test", help="validation split (default: test)")
    parser.add_argument("--max-examples", type=int, help="limit training examples")
    parser.add_argument("--agent", required=True, help="agent flow: registry name or module:object path")
    parser.add_argument("--evaluator", required=True, help="evaluator: registry name or module:object path")
    parser.add_argument("--model", default="Qwen/Qwen3-8B", help="model name/path (default: Qwen/Qwen3-8B)")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per prompt (default: 8)")
    parser.add_argument("--batch-size", type=int, default=32, help="training batch size (default: 32)")
    parser.add_argument("--lr", type=float, default=2e-5, help="learning rate (default: 2e-5)")
    parser.add_argument(
        "--lora-rank", type=int, default=32, help="LoRA rank, 0 for full weights (default: 32)"
    )
    parser.add_argument("--epochs", type=int, default=1, help="total training epochs (default: 1)")
    parser.add_argument("--max-steps", type=int, help="stop after N steps (overrides --epochs)")
    parser.add_argument("--val-freq", type=int, default=5, help="validate every N steps (default: 5)")
    parser.add_argument("--save-freq", type=int, default=20, help="checkpoint every N steps (default: 20)")
    parser.add_argument("--project", default="rllm-train", help="project name for logging")
    parser.add_argument("--experiment", help="experiment name (default: <benchmark>)")
    parser.add_argument("--output", help="checkpoint directory")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides of rLLM's unified config, e.g. rllm.trainer.logger=[console]",
    )
    return parser


def refuse_unsupported(argv: list[str]) -> None:
    """One line naming the first rLLM flag this command does not serve."""
    for word in argv:
        flag = word.split("=", 1)[0]
        if flag in UNSUPPORTED:
            raise UserFacingError(
                f"rllm-skyrl train: {flag} is not supported with backend=skyrl; drop it "
                "(rllm-skyrl train --help lists what is)"
            )


def overrides(args: argparse.Namespace) -> list[str]:
    """The flags as overrides of rLLM's ``unified`` config, the keys rLLM's CLI sets."""
    steps = (
        [f"rllm.trainer.total_batches={args.max_steps}", "rllm.trainer.total_epochs=1"]
        if args.max_steps
        else []
    )
    output = [f"training.default_local_dir={args.output}"] if args.output else []
    return [
        "rllm/backend=skyrl",
        f"model.name={args.model}",
        f"model.lora_rank={args.lora_rank}",
        f"training.group_size={args.group_size}",
        f"validation.group_size={args.group_size}",
        f"training.learning_rate={args.lr}",
        f"data.train_batch_size={args.batch_size}",
        f"rllm.trainer.total_epochs={args.epochs}",
        f"rllm.trainer.test_freq={args.val_freq}",
        f"rllm.trainer.save_freq={args.save_freq}",
        f"rllm.trainer.project_name={args.project}",
        f"rllm.trainer.experiment_name={args.experiment or args.benchmark}",
        *steps,
        *output,
        *args.overrides,
    ]


def load_rows(name: str, split: str, max_examples: int | None = None) -> Any:
    from rllm.data.dataset import DatasetRegistry

    dataset = DatasetRegistry.load_dataset(name, split)
    if dataset is None:
        raise UserFacingError(
            f"rllm-skyrl train: dataset {name!r} split {split!r} is not in rLLM's DatasetRegistry; "
            f"register it (rllm dataset pull {name}, or DatasetRegistry.register_dataset)"
        )
    if max_examples is not None:
        dataset = dataset.select(range(min(max_examples, len(dataset))))
    return dataset


def train(args: argparse.Namespace) -> None:
    from hydra import compose, initialize_config_module
    from rllm.eval.agent_loader import load_agent
    from rllm.eval.evaluator_loader import load_evaluator
    from rllm.trainer import AgentTrainer

    from rllm_skyrl.rllm_plugin import register

    train_rows = load_rows(args.train_dataset or args.benchmark, args.train_split, args.max_examples)
    val_rows = load_rows(args.val_dataset or args.benchmark, args.val_split)
    agent_flow, evaluator = load_agent(args.agent), load_evaluator(args.evaluator)
    with initialize_config_module("rllm.trainer.config", version_base=None):
        config = compose("unified", overrides=overrides(args))
    register()
    AgentTrainer(
        config=config,
        backend="skyrl",
        agent_flow=agent_flow,
        evaluator=evaluator,
        train_dataset=train_rows,
        val_dataset=val_rows,
    ).train()
