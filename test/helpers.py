"""What several test modules build the same way: SkyRL configs and batches, HF references, configs.

Test modules import from here (never from each other), so a test file can be run, moved or
deleted on its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

# --------------------------------------------------------------------------- fresh interpreters


def run_python(program: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """Run ``program`` in a new interpreter; it prints one JSON line last."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(program), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- SkyRL workers

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def skyrl_config(model_dir: str, tmp_path, **overrides):
    """SkyRL's typed config for a fp32 policy on ``model_dir``: plain AdamW, one micro-batch."""
    from rllm_skyrl.run_config import make_skyrl_config

    return make_skyrl_config(skyrl_overrides(model_dir, tmp_path, **overrides))


def skyrl_overrides(model_dir: str, tmp_path, **overrides) -> dict:
    """The dotted SkyRL keys behind ``skyrl_config`` (policy only: no KL term, so no reference)."""
    base = {
        "trainer.policy.model.path": model_dir,
        "trainer.policy.fsdp_config.mixed_precision": FP32,
        "trainer.policy.optimizer_config.lr": 1e-3,
        "trainer.policy.optimizer_config.weight_decay": 0.0,
        "trainer.gradient_checkpointing": False,
        "trainer.micro_train_batch_size_per_gpu": 8,
        "trainer.micro_forward_batch_size_per_gpu": 8,
        "trainer.algorithm.use_kl_loss": False,
        "generator.sampling_params.temperature": 1.0,
        "trainer.ckpt_path": str(Path(tmp_path) / "ckpt"),
        "trainer.export_path": str(Path(tmp_path) / "export"),
        "trainer.log_path": str(Path(tmp_path) / "logs"),
    }
    base.update(overrides)
    return base


PAIRS = [("what is 3?", " 3"), ("what is 12?", "1 2 3"), ("what is 7 plus 2?", " 9"), ("what is 5?", "5")]


def skyrl_batch(pad_token_id: int, prompts: list[list[int]], responses: list[list[int]]):
    """Token ids -> a loss-on-every-response-token ``TrainingInputBatch``, by SkyRL's own preprocessing."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors

    sequences, attention_mask, response_mask, _rewards, loss_mask, *_ = (
        convert_prompts_responses_to_batch_tensors(
            pad_token_id,
            prompts,
            responses,
            rewards=[[0.0] * len(r) for r in responses],
            loss_masks=[[1] * len(r) for r in responses],
        )
    )
    batch = TrainingInputBatch(
        {
            "sequences": sequences,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "loss_mask": loss_mask.float(),
        }
    )
    batch.metadata = {"response_length": response_mask.shape[1]}
    return batch


def sft_batch(tokenizer, pairs: list[tuple[str, str]] = PAIRS):
    """Prompt/response text pairs -> (batch, prompt ids, response ids); responses end with eos."""
    prompts = [tokenizer(p)["input_ids"] for p, _ in pairs]
    responses = [tokenizer(r)["input_ids"] + [tokenizer.eos_token_id] for _, r in pairs]
    return skyrl_batch(tokenizer.pad_token_id, prompts, responses), prompts, responses


def exported_weights(workers, role: str, export_dir: Path) -> dict[str, torch.Tensor]:
    """The role's current weights, exported as an HF model by the workers and read back."""
    from safetensors.torch import load_file

    workers.save_hf_model(role, str(export_dir))
    return load_file(str(Path(export_dir) / "model.safetensors"))


def hf_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


# --------------------------------------------------------------------------- HF references


def hf_model(model_dir: str | Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_logprobs(model, prompts, responses, temperature: float = 1.0) -> list[torch.Tensor]:
    """log_softmax(logits / T) of each response token under a plain, unpadded HF forward.

    ``model`` is a loaded HF causal LM or a directory to load one from.
    """
    if isinstance(model, (str, Path)):
        model = hf_model(model)
    out = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses, strict=True):
            ids = torch.tensor([list(prompt) + list(response)])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            out.append(logp.gather(-1, torch.tensor(list(response))[:, None]).squeeze(-1))
    return out


# --------------------------------------------------------------------------- composed configs


def compose_unified(*overrides: str, model: str | None = "tiny"):
    """The entry config (``unified``) of this checkout with ``model`` (None: unset) and ``overrides``.

    Composed from the checkout's ``config/`` folder, not through the installed package (which an
    editable install may map to another checkout); ``test_packaging.py`` covers the package.
    """
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "config"), version_base=None):
        return compose("unified", overrides=[*([f"model.path={model}"] if model else []), *overrides])


def compose_three_ways(settings: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The entry config with ``settings`` ({dotted key: value}) given three ways: as command-line
    overrides, in a yaml file that composes ``unified``, and merged in as a dict.

    The three hold the same content, so the config layer must resolve them alike.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    nested: dict[str, Any] = {}
    for key, value in settings.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    overrides = [f"++{key}={json.dumps(value)}" for key, value in settings.items()]
    command_line = compose_unified(*overrides, model=None)
    directory = tmp_path / "yaml_config"
    directory.mkdir()
    primary = {"defaults": ["unified", "_self_"], "hydra": {"searchpath": [f"file://{REPO / 'config'}"]}}
    (directory / "run.yaml").write_text(OmegaConf.to_yaml({**primary, **nested}))
    with initialize_config_dir(config_dir=str(directory), version_base=None):
        yaml_file = compose("run")
    merged = compose_unified(model=None)
    with open_dict(merged):
        merged.merge_with(nested)
    return {"command line": command_line, "yaml file": yaml_file, "dict": merged}


def compose_run(*overrides: str, model: str = "tiny"):
    """What a training script composes (``apps/run.yaml``): the config ``training_run.train`` runs
    under rLLM's trainer where rLLM is installed, under the fallback where not."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "test" / "apps"), version_base=None):
        return compose("run", overrides=[f"model.path={model}", *overrides])


def compose_example(example: str, *overrides: str):
    """``examples/<example>/config.yaml`` with ``overrides``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(EXAMPLES / example), version_base=None):
        return compose("config", overrides=list(overrides))


def partly_taught(model_dir: str, model_key: str = "model.path") -> list[str]:
    """Overrides that start a learning curve from ``conftest.partly_taught_model`` at the pace it
    takes (lr 3e-3: past a reward of 0.8 in ~30 steps). rLLM's config names the model ``model.name``."""
    return [f"{model_key}={model_dir}", "training.learning_rate=3e-3"]


def run_dirs(root: Path) -> list[str]:
    """Overrides that keep a run's checkpoints and metrics under ``root``."""
    return [f"training.default_local_dir={root}/ckpt", f"rllm.trainer.run_dir={root}/run"]


# --------------------------------------------------------------------------- waiting


def wait_until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.01) -> Any:
    """Poll ``condition`` until it returns something truthy, and return that; after ``timeout``
    seconds fail naming ``what`` (a missed moment is a clear failure, never a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


async def async_wait_until(condition, timeout: float, what: str, interval: float = 0.005) -> Any:
    """``wait_until`` for an async ``condition`` (a coroutine function), on the running loop."""
    import asyncio

    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(interval)


# --------------------------------------------------------------------------- processes


def descendants(pid: int) -> list:
    """Every process ``pid`` started, recursively (``psutil.Process`` objects; empty once it is gone)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def reap(processes: list, timeout: float = 60.0) -> list[int]:
    """Wait for processes a test started to exit; SIGKILL (by pid) the ones that outlive ``timeout``.

    Returns the pids that had to be killed.
    """
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=timeout)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in alive]


def server_vs_trainer(engine, workers, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample 8 completions; return (server logprobs, trainer logprobs) of the same tokens."""

    async def sample():
        messages = [[{"role": "user", "content": f"what is {i}?"}] for i in range(8)]
        return await asyncio.gather(*(engine.get_model_response(m, seed=i) for i, m in enumerate(messages)))

    outputs = asyncio.run(sample())
    batch = skyrl_batch(
        tokenizer.pad_token_id, [o.prompt_ids for o in outputs], [o.completion_ids for o in outputs]
    )
    trained = workers.forward("policy", batch, loss_fn="cross_entropy").loss_fn_outputs
    server = torch.cat([torch.tensor(o.logprobs) for o in outputs])
    trainer = torch.cat([torch.tensor(t["logprobs"]) for t in trained])
    assert server.numel() == trainer.numel() >= 8
    return server, trainer


def policy_checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """The policy's weights and AdamW moments from a SkyRL checkpoint step directory, as fp32."""

    def full(tensor):
        return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    model = torch.load(step_dir / "policy" / "model_world_size_1_rank_0.pt", weights_only=False)
    optim = torch.load(step_dir / "policy" / "optim_world_size_1_rank_0.pt", weights_only=False)
    tensors = {f"model/{k}": full(v).float() for k, v in model.items()}
    for index, moments in optim["state"].items():
        for name, value in moments.items():
            tensors[f"optim/{index}/{name}"] = full(torch.as_tensor(value)).float()
    return tensors


# --------------------------------------------------------------------------- rLLM-shaped records


# Duck-typed stand-ins for rLLM's records: the adapter and the advantages only read attributes.
@dataclass
class Step:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] | None = None
    reward: float | None = 0.0
    advantage: Any = None
    done: bool = False
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.logprobs is None:
            self.logprobs = [-0.5 - 0.01 * i for i in range(len(self.response_ids))]


@dataclass
class Trajectory:
    steps: list[Step]
    reward: float | None = 1.0
    name: str = "solver"
    uid: str = "traj-uid"


@dataclass
class TrajectoryGroup:
    trajectories: list[Trajectory]
    group_id: str = "task-3:solver"
    metadata: list[dict] = field(default_factory=list)


def group_of(*trajectories: Trajectory, task: str = "task-3") -> TrajectoryGroup:
    metadata = [{"task_id": task, "rollout_idx": i} for i in range(len(trajectories))]
    return TrajectoryGroup(list(trajectories), f"{task}:{trajectories[0].name}", metadata)


# --------------------------------------------------------------------------- taught tiny models


def taught_model(
    model_dir: str | Path,
    examples: list[tuple[list[dict], list[dict] | None, str]],
    steps: int = 80,
    cache_dir: Path | None = None,
) -> Path:
    """The tiny model fine-tuned until it replies ``reply`` to each ``(messages, tools, reply)``: a
    model that really writes a given text (a tool call, an answer) when a test needs the server or
    a flow to see one. Loss on the reply and its end token only. Saved beside the tiny models, keyed
    by the base model and the examples, so a test run teaches each one once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rllm_skyrl.tiny_model import default_cache_dir

    key = hashlib.sha256(json.dumps([str(model_dir), examples, steps], sort_keys=True).encode()).hexdigest()
    out = Path(cache_dir or default_cache_dir()) / f"taught-{key[:16]}"
    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rows = []
    for messages, tools, reply in examples:
        prompt = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        reply_ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt_ids + reply_ids])
        labels = ids.clone()
        labels[0, : len(prompt_ids)] = -100
        rows.append((ids, labels))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend (15x slower on two cores)
    try:
        for step in range(steps):
            ids, labels = rows[step % len(rows)]
            model(input_ids=ids, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another test process taught the same model first
        shutil.rmtree(tmp, ignore_errors=True)
    return out
