"""rLLM's ``AgentSFTTrainer(spec, backend="skyrl")`` on SkyRL's SFT trainer (examples/sft), end to end.

One 100-step run on the successor task is shared: its loss falls, the model answers held-out
questions it could not answer before (greedy), ``rllm-skyrl sft`` (rLLM's ``rllm sft`` flags, as a
subprocess) resumes it from its latest checkpoint, and its HF export starts an RL run under rLLM's
``AgentTrainer(backend="skyrl")``. Besides: LoRA, and a bad row refused before anything starts.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import ray
from helpers import compose_example, run_dirs

from examples.sft.task import answer, digit_reward, make_rows, messages_rows, question, split
from examples.sft.train import DEFAULTS, train_sft
from rllm_skyrl.run.metrics_file import read_metrics
from rllm_skyrl.sft.placement import live_placement_groups

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]
CLI = Path(sys.executable).with_name("rllm-skyrl")
STEPS = DEFAULTS["epochs"] * len(split()[0]) // DEFAULTS["batch_size"]  # 100: shorter ones answer fewer


def greedy_answers(model_dir: str | Path) -> list[tuple[str, str, str]]:
    """(question, answer, the model's greedy reply) for each held-out item, prompted as RL serves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    replies = []
    for digit, phrasing in split()[1]:
        messages = [{"role": "user", "content": question(digit, phrasing)}]
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        output = model.generate(**prompt, max_new_tokens=2, do_sample=False)
        reply = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        replies.append((question(digit, phrasing), answer(digit), reply))
    return replies


def correct(replies: list[tuple[str, str, str]]) -> int:
    return sum(reply.startswith(want) for _, want, reply in replies)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    before = reserved()
    started = time.perf_counter()
    backend = train_sft(out)
    print(f"SFT, {STEPS} steps: {time.perf_counter() - started:.0f} s")
    # The workers' placement group and GPUs are given back to the shared Ray (asynchronously).
    deadline = time.monotonic() + 120
    while reserved() != before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert reserved() == before
    return backend, read_metrics(out)


def reserved() -> tuple[set[str], float]:
    """The live placement groups and the GPUs Ray has not handed out."""
    return set(live_placement_groups()), ray.available_resources().get("GPU", 0.0)


def test_loss_falls_and_the_model_answers_held_out_questions(sft_run, tiny_model_dir):
    backend, records = sft_run
    train = [r for r in records if "train_mean_nll" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    curve = [
        (r["step"], round(r["train_mean_nll"], 3)) for r in train if r["step"] in (1, 10, 25, 50, 75, 100)
    ]
    val = [(r["step"], round(r["test/mean_nll"], 3)) for r in records if "test/mean_nll" in r]
    print(f"train_mean_nll {curve}; test/mean_nll {val}")
    first, last = (statistics.fmean(r["train_mean_nll"] for r in part) for part in (train[:5], train[-5:]))
    assert last < 0.1 * first
    assert [step for step, _ in val] == [25, 50, 75, 100] and val[-1][1] < 0.3 * val[0][1]
    for record in train:  # rLLM's names, with the values they have in its tinker loop
        assert record["learning_rate"] == pytest.approx(3e-3) and record["num_sequences"] == 10
        assert record["num_loss_tokens"] > 0 and record["num_tokens"] > record["num_loss_tokens"]
        assert record["epoch"] == (record["step"] - 1) // 5 and record["time/total"] > 0
    assert train[-1]["progress"] == 1.0
    before, after = greedy_answers(tiny_model_dir), greedy_answers(backend.model_dir)
    print(f"held-out before: {before}\nheld-out after: {after}")
    assert correct(before) <= 1 and correct(after) >= 8


def test_sft_then_rl_under_rllms_agent_trainer(sft_run, tmp_path):
    """The SFT export is the RL run's model.path; its first step already answers most questions."""
    from rllm.data import Dataset
    from rllm.trainer import AgentTrainer

    from examples.simple_math.workflow import AskOnceWorkflow
    from rllm_skyrl import rllm_plugin

    backend, _ = sft_run
    cfg = compose_example(
        "simple_math",
        *run_dirs(tmp_path),
        f"model.path={backend.model_dir}",
        "rllm.trainer.total_batches=3",
        "rllm.trainer.test_freq=0",
        "training.group_size=8",
        "training.learning_rate=3e-4",
    )
    rllm_plugin.register()
    try:
        AgentTrainer(
            config=cfg,
            workflow_class=AskOnceWorkflow,
            workflow_args={"reward_function": digit_reward},
            train_dataset=Dataset(make_rows(256)),
            backend="skyrl",
        ).train()
    finally:
        rllm_plugin.unregister()
    rewards = [r["reward/mean"] for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    print(f"RL from the SFT export, reward/mean per step: {rewards}")
    assert len(rewards) == 3 and min(rewards) > 0.6


def test_lora_trains_adapters_and_exports_a_merged_model(tmp_path, tiny_model_dir):
    """Adapters on every linear layer train, and the merged export is the trained model. (On the
    random-init tiny model the frozen embeddings and head let adapters lower the loss only a little.)"""
    from safetensors.torch import load_file

    backend = train_sft(tmp_path, lora_rank=8, epochs=4, lr=1e-2, val_freq=0, save_freq=0)
    train = [r["train_mean_nll"] for r in read_metrics(tmp_path) if "train_mean_nll" in r]
    print(f"LoRA train_mean_nll: {[round(loss, 2) for loss in train]}")
    last = statistics.fmean(train[-3:])
    assert len(train) == 20 and last < 0.95 * statistics.fmean(train[:3])
    assert (backend.export_dir / "adapter_config.json").exists()
    base = load_file(Path(tiny_model_dir) / "model.safetensors")
    merged = load_file(backend.model_dir / "model.safetensors")
    changed = {name for name in base if not (base[name] == merged[name]).all()}
    assert changed and all("proj" in name for name in changed)  # adapted linear layers only
    rows = Path(backend.checkpoint_dir) / "_skyrl_inputs" / "train.parquet"
    base_nll, merged_nll = mean_nll(tiny_model_dir, rows), mean_nll(backend.model_dir, rows)
    print(f"train rows' mean NLL: base {base_nll:.3f}, merged {merged_nll:.3f}, run's last steps {last:.3f}")
    assert merged_nll < base_nll - 0.3 and abs(merged_nll - last) < 0.3


def mean_nll(model_dir: str | Path, rows: Path) -> float:
    """Mean NLL of the loss-masked tokens of pretokenized rows under the model (plain transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in pd.read_parquet(rows).itertuples():
            ids = torch.tensor([list(row.input_ids)])
            mask = torch.tensor(list(row.loss_mask))[1:].bool()
            logprobs = model(ids).logits[0, :-1].log_softmax(-1)
            nll = -logprobs.gather(-1, ids[0, 1:, None])[:, 0]
            total, count = total + nll[mask].sum().item(), count + int(mask.sum())
    return total / count


def write_split(path: Path, rows: list[dict]) -> Path:
    pd.DataFrame(rows).to_parquet(path)
    return path


def test_rllm_skyrl_sft_resumes_the_shared_run_with_rllm_sfts_flags(sft_run, tmp_path):
    """``rllm-skyrl sft`` with the shared run's settings as rLLM's flags, in a copy of its directory:
    it resumes from the latest checkpoint and trains one epoch more."""
    backend, _ = sft_run
    source = Path(backend.checkpoint_dir)
    assert (source / "latest_ckpt_global_step.txt").read_text() == str(STEPS)
    assert (source / f"global_step_{STEPS // 2}" / "policy").is_dir()
    out = tmp_path / "run"
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("hf_exports", "logs"))
    train, heldout = split()
    train_file = write_split(tmp_path / "train.parquet", messages_rows(train))
    val_file = write_split(tmp_path / "val.parquet", messages_rows(heldout))
    args = [
        str(CLI), "sft", "--train-file", str(train_file), "--val-file", str(val_file), "--model", "tiny",
        "--lora-rank", "0", "--lr", str(DEFAULTS["lr"]), "--batch-size", str(DEFAULTS["batch_size"]),
        "--epochs", str(DEFAULTS["epochs"] + 1), "--max-length", str(DEFAULTS["max_length"]),
        "--tokenize-method", DEFAULTS["tokenize_method"], "--val-freq", "5", "--save-freq", "0",
        "--output", str(out),
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=900, env=os.environ)
    transcript = result.stdout + result.stderr
    print(f"$ rllm-skyrl {' '.join(args[1:])}\n{transcript[-4000:]}")
    assert result.returncode == 0, transcript[-3000:]
    assert "skyrl" in transcript and "train.parquet" in transcript  # rLLM's summary panel
    records = [r for r in read_metrics(out) if "train_mean_nll" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 6))
    # The weights, optimizer and data position came back: the first new step trains at the loss the
    # run had reached (its first step, from random weights, was above 4).
    assert records[STEPS]["train_mean_nll"] < 0.1 * records[0]["train_mean_nll"]
    assert (out / f"global_step_{STEPS + 5}" / "policy").is_dir()


def test_rllm_skyrl_sft_refuses_a_bad_row_before_starting(tmp_path):
    rows = [*messages_rows(split()[0][:3]), {"messages": [{"role": "user", "content": "no answer"}]}]
    train_file = write_split(tmp_path / "train.parquet", rows)
    args = [
        str(CLI),
        "sft",
        "--train-file",
        str(train_file),
        "--model",
        "tiny",
        "--output",
        str(tmp_path / "r"),
    ]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env=os.environ)
    assert result.returncode != 0
    assert "train row 3: no assistant message, so nothing to train on" in result.stdout + result.stderr
    assert not (tmp_path / "r" / "logs").exists()  # Ray never started


def test_rllm_skyrl_sft_help_lists_rllm_sfts_flags_and_skyrl():
    from click.testing import CliRunner

    from rllm_skyrl.cli import sft_command

    help_text = CliRunner().invoke(sft_command(), ["--help"], prog_name="rllm-skyrl sft").output
    assert "[tinker|verl|fireworks|skyrl]" in help_text and "--tokenize-method" in help_text
    assert "default: skyrl" in help_text
