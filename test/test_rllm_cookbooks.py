"""rLLM's cookbooks train on SkyRL: each cookbook's own ``train.py`` and flow modules, read from the
rLLM source and run as written, with only the backend, the model and the sizes changed.

Every cookbook is installed as its README says (``scripts/install_cookbooks.sh``, with the
dependencies its pyproject declares); its data is a few local rows registered in rLLM's
``DatasetRegistry`` under the names its ``train.py`` loads, in the row format of that dataset. Each
run is two training steps and a validation, with the tiny model. Each ``train.py`` runs in its own
interpreter, as its README runs it, so each starts its own Ray.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO
from rllm_harness import requires_rllm

pytestmark = requires_rllm

COOKBOOKS = ("math", "solver_judge_flow", "math_tool_agent", "frozenlake", "agent_frameworks", "deepcoder")
# What each is installed with: agent_frameworks's default agent is its LangGraph flow.
EXTRAS = {"agent_frameworks": "[langgraph]"}
SIZES = [
    "training.group_size=2",
    "data.train_batch_size=2",
    "data.val_batch_size=2",
    "data.max_response_length=24",
    "rllm.trainer.total_batches=2",
    "rllm.trainer.total_epochs=1",
    "rllm.trainer.test_freq=2",  # validates after the second step
    "rllm.trainer.save_freq=-1",
    "rllm.trainer.logger=[console]",
]
TRAIN_ROWS = 4  # two batches of two
TEST_ROWS = 2


def cookbook_dir(name: str) -> Path:
    import rllm

    return Path(rllm.__file__).resolve().parent.parent / "cookbooks" / name


@pytest.fixture(scope="module")
def installed() -> None:
    names = [name + EXTRAS.get(name, "") for name in COOKBOOKS]
    subprocess.run([str(REPO / "scripts/install_cookbooks.sh"), *names], check=True, timeout=900)


@pytest.mark.slow
def test_installing_a_cookbook_leaves_rllm_and_this_package_in_place(installed):
    """The other test process runs training meanwhile: its new processes (Ray workers) must find
    rLLM and this package importable at every moment, so neither is reinstalled."""
    marks = sorted(Path(sys.prefix).glob("lib/python*/site-packages/__editable__*rllm*"))
    assert len(marks) >= 4, f"rLLM and this package are not both editable installs in {sys.prefix}: {marks}"
    before = {path: path.stat().st_mtime_ns for path in marks}
    subprocess.run([str(REPO / "scripts/install_cookbooks.sh"), "math"], check=True, timeout=900)
    assert {path: path.stat().st_mtime_ns for path in marks} == before


@pytest.fixture(scope="module")
def long_context_model() -> str:
    """The tiny model with room for the cookbooks' system prompts and multi-turn chats."""
    from rllm_skyrl.tiny_model import TinyModelConfig, build_tiny_model

    return str(build_tiny_model(TinyModelConfig(max_position_embeddings=8192)))


def register(name: str, split: str, rows: list[dict]) -> None:
    from rllm.data.dataset import DatasetRegistry

    DatasetRegistry.register_dataset(name, rows, split=split)


def math_rows(count: int, seed: int, source: str) -> list[dict]:
    """Rows as ``rllm dataset pull hendrycks_math / math500 / deepscaler_math`` store them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(
            {
                "question": f"What is {a} plus {b}?",
                "ground_truth": str(a + b),
                "answer": str(a + b),
                "data_source": source,
            }
        )
    return rows


def countdown_rows(count: int, seed: int) -> list[dict]:
    """Rows as rLLM's countdown transform returns them: ``{target, nums, data_source}``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        nums = [rng.randint(1, 9) for _ in range(3)]
        rows.append({"target": nums[0] + nums[1] - nums[2], "nums": nums, "data_source": "countdown"})
    return rows


def frozenlake_rows(count: int, seed: int) -> list[dict]:
    """Rows as ``prepare_frozenlake_data.py`` writes them, on small maps with a few turns each."""
    return [
        {
            "seed": seed + i,
            "size": 3,
            "p": 0.8,
            "is_slippery": False,
            "max_steps": 3,
            "data_source": "frozenlake",
        }
        for i in range(count)
    ]


def deepcoder_rows(count: int, seed: int) -> list[dict]:
    """Rows as ``prepare_deepcoder_data.py`` writes them: stdin/stdout tests, graded by running the
    code on this machine (LiveCodeBench's runner, no sandbox)."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        pairs = [(rng.randint(1, 99), rng.randint(1, 99)) for _ in range(2)]
        tests = [
            {
                "input": f"{a} {b}\n",
                "output": f"{a + b}\n",
                "testtype": "stdin_stdout",
                "metadata": {"func_name": None},
            }
            for a, b in pairs
        ]
        rows.append(
            {
                "uid": f"deepcoder_{seed}_{index}",
                "index": index,
                "question": "Read two integers from one line of standard input and print their sum.",
                "ground_truth": json.dumps(tests),
                "data_source": "livecodebench",
                "starter_code": "",
                "metadata": json.dumps({}),
            }
        )
    return rows


DATASETS = {
    "math": lambda: [
        ("hendrycks_math", "train", math_rows(TRAIN_ROWS, 0, "hendrycks_math")),
        ("math500", "test", math_rows(TEST_ROWS, 1, "math500")),
    ],
    "solver_judge_flow": lambda: [
        ("countdown", "train", countdown_rows(TRAIN_ROWS, 0)),
        ("countdown", "test", countdown_rows(TEST_ROWS, 1)),
    ],
    "math_tool_agent": lambda: [
        ("deepscaler_math", "train", math_rows(TRAIN_ROWS, 0, "deepscaler_math")),
        ("math500", "test", math_rows(TEST_ROWS, 1, "math500")),
    ],
    "frozenlake": lambda: [
        ("frozenlake", "train", frozenlake_rows(TRAIN_ROWS, 0)),
        ("frozenlake", "test", frozenlake_rows(TEST_ROWS, 100)),
    ],
    "agent_frameworks": lambda: [
        ("deepscaler_math", "train", math_rows(TRAIN_ROWS, 0, "deepscaler_math")),
        ("math500", "test", math_rows(TEST_ROWS, 1, "math500")),
    ],
    "deepcoder": lambda: [
        ("deepcoder", "train", deepcoder_rows(TRAIN_ROWS, 0)),
        ("deepcoder", "test", deepcoder_rows(TEST_ROWS, 1)),
    ],
}


def run_cookbook(name: str, model: str, tmp_path: Path) -> dict:
    for dataset, split, rows in DATASETS[name]():
        register(dataset, split, rows)
    command = [
        sys.executable,
        str(cookbook_dir(name) / "train.py"),
        "rllm/backend=skyrl",
        f"model.name={model}",
        *SIZES,
        f"rllm.trainer.run_dir={tmp_path}/run",
        f"training.default_local_dir={tmp_path}/ckpt",
        f"hydra.run.dir={tmp_path}/hydra",
    ]
    start = time.monotonic()
    result = subprocess.run(
        command, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=1500
    )
    wall = time.monotonic() - start
    assert result.returncode == 0, f"{shlex.join(command)}\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step" in r]
    validation = {k: v for r in records for k, v in r.items() if k.startswith("val/")}
    print(f"\ncookbook {name}: {len(steps)} steps, wall {wall:.0f} s, validation {validation}", flush=True)
    return {
        "steps": steps,
        "records": records,
        "validation": validation,
        "output": result.stdout + result.stderr,
    }


def check_trained(run: dict) -> None:
    assert [r["step"] for r in run["steps"]] == [1, 2], run["records"]
    for step in run["steps"]:
        assert "train/kl_sample_train_v1" in step, f"no trajectory was trained on: {step}"
        assert any(k.startswith("reward/") or "reward" in k for k in step), step
    assert run["validation"], f"no validation figure in {run['records']}"


@pytest.mark.slow
@pytest.mark.parametrize("name", COOKBOOKS)
def test_cookbook_trains_unchanged(name, installed, long_context_model, tmp_path):
    check_trained(run_cookbook(name, long_context_model, tmp_path))


def test_deepcoder_rows_are_graded_by_running_the_code_here():
    """The rows the deepcoder run trains on are the cookbook's own format, and its evaluator grades
    them by running the answer on this machine: a right program scores 1, a wrong one 0."""
    from rllm.types import Episode

    sys.path.insert(0, str(cookbook_dir("deepcoder")))
    try:
        from deepcoder_eval import deepcoder_evaluator
    finally:
        sys.path.pop(0)
    (row,) = deepcoder_rows(1, 0)
    answers = {
        "```python\na, b = map(int, input().split())\nprint(a + b)\n```": 1.0,
        "```python\na, b = map(int, input().split())\nprint(a - b)\n```": 0.0,
    }
    for answer, reward in answers.items():
        episode = Episode(artifacts={"answer": answer})
        assert deepcoder_evaluator.evaluate(row, episode).reward == reward, answer


def test_finqa_is_refused_in_one_line_without_its_judge():
    """finqa's evaluator grades through OpenAI's API; without a key it would score every episode 0."""
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    result = subprocess.run(
        [str(REPO / "scripts/install_cookbooks.sh"), "math", "finqa"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: finqa is left out: ") and "OPENAI_API_KEY" in line, line


def test_geo3k_is_refused_in_one_line_with_a_text_only_model(tiny_model_dir):
    """geo3k's rows carry images; a text-only policy would score every episode zero unseen."""
    from omegaconf import OmegaConf
    from rllm.trainer import AgentTrainer

    from rllm_skyrl.rllm_plugin import register

    register()
    sys.path.insert(0, str(cookbook_dir("geo3k")))
    try:
        from geo3k_eval import geo3k_evaluator
        from geo3k_flow import geo3k_flow
    finally:
        sys.path.pop(0)
    rows = [{"question": "<image>Find x.", "ground_truth": "3", "images": [{"bytes": b"png", "path": None}]}]
    config = OmegaConf.create({"model": {"name": tiny_model_dir}, "rllm": {}})
    with pytest.raises(ValueError) as refused:
        AgentTrainer(
            config=config,
            backend="skyrl",
            agent_flow=geo3k_flow,
            evaluator=geo3k_evaluator,
            train_dataset=rows,
            val_dataset=rows,
        )
    message = str(refused.value)
    assert "\n" not in message
    assert f"train_dataset rows carry images ('images') but model {tiny_model_dir} is text-only" in message


def test_cli_refuses_an_unsupported_rllm_flag_by_name():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rllm_skyrl.cli",
            "train",
            "hendrycks_math",
            "--agent",
            "math",
            "--temperature",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: rllm-skyrl train: --temperature is not supported with backend=skyrl; drop it "
        "(rllm-skyrl train --help lists what is)"
    )


@pytest.mark.slow
def test_cli_trains_a_cookbook_agent_by_its_registered_names(installed, long_context_model, tmp_path):
    """``rllm-skyrl train`` as rLLM's README runs ``rllm train``: agent and evaluator by the names the
    math cookbook registers as entry points, the dataset by its registry name."""
    for dataset, split, rows in DATASETS["math"]():
        register(dataset, split, rows)
    command = [
        sys.executable, "-m", "rllm_skyrl.cli", "train", "hendrycks_math",
        "--val-dataset", "math500", "--agent", "math", "--evaluator", "math",
        "--model", long_context_model, "--group-size", "2", "--batch-size", "2", "--lora-rank", "0",
        "--max-steps", "2", "--val-freq", "2", "--output", str(tmp_path / "ckpt"),
        "data.max_response_length=24", "rllm.trainer.logger=[console]",
        f"rllm.trainer.run_dir={tmp_path}/run",
    ]  # fmt: skip
    start = time.monotonic()
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    wall = time.monotonic() - start
    transcript = f"$ {shlex.join(command)}\n{result.stdout}{result.stderr}"
    (tmp_path / "transcript.txt").write_text(transcript)
    print(f"\nrllm-skyrl train: exit {result.returncode}, wall {wall:.0f} s, in {tmp_path}/transcript.txt")
    assert result.returncode == 0, transcript[-8000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "time/step" in r] == [1, 2]
    assert any(k.startswith("val/") for r in records for k in r)
