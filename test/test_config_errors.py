"""A wrong setting is one line naming the key, the value and what is allowed, before anything starts.

Through every entry point a user has: ``train.sh`` (the quickstart's Hydra app), the rLLM
entry (rLLM's config, ``AgentTrainer(backend="skyrl")``), and ``rllm-skyrl plan``. Each value below
is refused with exit code 2, no traceback, and no Ray started.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rllm_skyrl.cli import main as rllm_skyrl_cli
from rllm_skyrl.run_config.values import RULES

REPO = Path(__file__).resolve().parent.parent

# (override, what the error must say). One bad value per key, every kind of rule.
BAD = [
    ("training.group_size=0", "training.group_size=0: expected an integer >= 1"),
    ("validation.group_size=-2", "validation.group_size=-2"),
    ("training.learning_rate=-1", "training.learning_rate=-1: expected a number > 0"),
    ("training.critic_learning_rate=0", "training.critic_learning_rate=0"),
    ("training.weight_decay=-0.1", "training.weight_decay=-0.1: expected a number >= 0"),
    ("training.max_grad_norm=0", "training.max_grad_norm=0"),
    ("training.beta1=1.5", "training.beta1=1.5: expected a number in [0, 1)"),
    ("training.beta2=-0.1", "training.beta2=-0.1"),
    ("training.num_minibatches=0", "training.num_minibatches=0"),
    ("training.update_epochs=0", "training.update_epochs=0"),
    ("training.max_ckpts_to_keep=0", "training.max_ckpts_to_keep=0: expected -1 (keep all) or >= 1"),
    ("training.drop_malformed=maybe", "training.drop_malformed='maybe': expected true or false"),
    ("training.resume_mode=sometimes", "training.resume_mode='sometimes'"),
    ("training.loss_fn_config=7", "training.loss_fn_config=7"),
    ("inference.num_engines=0", "inference.num_engines=0"),
    ("inference.max_model_len=-5", "inference.max_model_len=-5"),
    ("inference.max_batch_size=0", "inference.max_batch_size=0"),
    ("inference.threads=0", "inference.threads=0"),
    ("training.cpu_threads=-1", "training.cpu_threads=-1"),
    ("inference.deterministic_sampling=2", "inference.deterministic_sampling=2"),
    ("inference.urls=[ftp://x]", "inference.urls=['ftp://x']: expected a non-empty list of http(s) URLs"),
    ("rllm.data.train_batch_size=0", "rllm.data.train_batch_size=0"),
    ("rllm.data.val_batch_size=0", "rllm.data.val_batch_size=0: expected -1 (all) or >= 1"),
    ("rllm.data.max_prompt_length=0", "rllm.data.max_prompt_length=0"),
    ("rllm.data.max_response_length=-1", "rllm.data.max_response_length=-1"),
    ("rllm.rollout.n=0", "rllm.rollout.n=0"),
    ("rllm.rollout.train.temperature=0", "rllm.rollout.train.temperature=0: expected a number > 0"),
    ("rllm.rollout.train.top_p=1.5", "rllm.rollout.train.top_p=1.5: expected a number in (0, 1]"),
    ("rllm.rollout.val.temperature=-1", "rllm.rollout.val.temperature=-1"),
    ("rllm.trainer.total_epochs=0", "rllm.trainer.total_epochs=0"),
    ("rllm.trainer.test_freq=-1", "rllm.trainer.test_freq=-1"),
    ("rllm.trainer.project_name=''", "rllm.trainer.project_name=''"),
    ("rllm.workflow.n_parallel_tasks=0", "rllm.workflow.n_parallel_tasks=0"),
    ("rllm.workflow.retry_limit=0", "rllm.workflow.retry_limit=0"),
    ("rllm.algorithm.kl_beta=-0.1", "rllm.algorithm.kl_beta=-0.1"),
    ("rllm.algorithm.eps_clip=1.5", "rllm.algorithm.eps_clip=1.5: expected a number in (0, 1)"),
    ("rllm.algorithm.warmup_steps_ratio=2", "rllm.algorithm.warmup_steps_ratio=2"),
    ("rllm.algorithm.adv_estimator=vtrace", "rllm.algorithm.adv_estimator='vtrace'"),
    ("rllm.algorithm.loss_agg_mode=token-max", "rllm.algorithm.loss_agg_mode='token-max'"),
    ("rllm.algorithm.loss_fn=vanilla", "rllm.algorithm.loss_fn / training.loss_fn_config: unknown loss_fn"),
    ("rllm.algorithm.router_replay=R3", "rllm.algorithm.router_replay='R3': expected 'disabled' (R2 and R3"),
    ("rllm.algorithm.use_rllm=false", "rllm.algorithm.use_rllm=False: expected null or true"),
    (
        "rllm.stepwise_advantage.mode=per_step",
        "rllm.stepwise_advantage.mode='per_step': expected 'broadcast'",
    ),
    ("rllm.algorithm.rollout_correction.tis_mode=tokens", "tis_mode='tokens': expected null (off), token or"),
    ("rllm.algorithm.rollout_correction.tis_cap=0", "rllm.algorithm.rollout_correction.tis_cap=0: expected"),
    ("rllm.algorithm.rollout_correction.bypass_mode=2", "rllm.algorithm.rollout_correction.bypass_mode=2"),
    ("rllm.async_training.mini_batch_size=0", "rllm.async_training.mini_batch_size=0"),
    ("skyrl.trainer.seed=abc", "skyrl.trainer.seed='abc': expected an integer"),
    ("skyrl.trainer.micro_train_batch_size_per_gpu=0", "skyrl.trainer.micro_train_batch_size_per_gpu=0"),
    ("model.path=/nonexistent/model", "model.path='/nonexistent/model': no such model directory"),
    ("data.train_files=train.parquet", "data.train_files='train.parquet' (tinker, verl): datasets are given"),
]

# One key of each kind of rule and section: what each entry must route to its one line. The
# in-process ``plan`` test runs the whole table; the entries run it in CI (slow: ~0.6 s a value).
ENTRY_SAMPLE = [
    (override, expected)
    for override, expected in BAD
    if override.split("=")[0]
    in {
        "training.group_size",
        "training.learning_rate",
        "training.beta1",
        "training.drop_malformed",
        "training.resume_mode",
        "inference.urls",
        "rllm.data.val_batch_size",
        "rllm.rollout.train.top_p",
        "rllm.algorithm.loss_fn",
        "rllm.algorithm.use_rllm",
        "rllm.algorithm.rollout_correction.tis_mode",
        "skyrl.trainer.seed",
        "model.path",
        "data.train_files",
    }
]

# The same checks reached from rLLM's config: keys rLLM's base defines, our backend's, aliases.
RUNNER = textwrap.dedent(
    """
    import io, json, sys
    from contextlib import redirect_stderr
    from rllm_skyrl.compat import local_ray
    launches = []  # a local Ray launched for the run, even if stopped again at the refusal
    launch = local_ray.launch
    local_ray.launch = lambda *args, **kwargs: launches.append(args) or launch(*args, **kwargs)
    module = __import__(sys.argv[1], fromlist=["main"])
    overrides, base = json.loads(sys.argv[2]), json.loads(sys.argv[3])
    results = []
    for override in overrides:
        sys.argv = ["entry", *base, override]
        err = io.StringIO()
        code = None
        with redirect_stderr(err):
            try:
                module.main()
            except SystemExit as stop:
                code = stop.code
        results.append({"override": override, "code": code, "stderr": err.getvalue()})
    import ray
    print(json.dumps({"results": results, "ray_started": ray.is_initialized() or bool(launches)}))
    """
)


def _run_entry(module: str, overrides: list[str], base: list[str], tmp_path: Path) -> dict:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    result = subprocess.run(
        [sys.executable, "-c", RUNNER, module, json.dumps(overrides), json.dumps(base)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_one_line(stderr: str, expected: str, code) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, stderr[-2000:]
    assert expected in errors[0], errors[0]
    assert "Traceback" not in stderr, stderr[-2000:]


def test_the_table_covers_every_kind_of_setting():
    assert len(BAD) >= 30
    checked = {override.split("=")[0] for override, _ in BAD}
    assert len(checked & {rule.key for rule in RULES}) >= 30


# plan describes a cluster whose model need not be on this machine: it checks every value but the path.
PLAN_BAD = [(override, expected) for override, expected in BAD if not override.startswith("model.path")]


@pytest.mark.parametrize(("override", "expected"), PLAN_BAD, ids=[o for o, _ in PLAN_BAD])
def test_plan_refuses_in_one_line(override, expected, capsys):
    with pytest.raises(SystemExit) as stop:
        rllm_skyrl_cli(["plan", "model.path=tiny", override])
    _assert_one_line(capsys.readouterr().err, expected, stop.value.code)


@pytest.fixture(scope="module")
def entry_table(slow_selected) -> list[tuple[str, str]]:
    """What each entry runs: the whole table when the slow tests run too (CI), the sample otherwise.
    The sample is part of the table, so one start of each entry serves both tests."""
    return BAD if slow_selected else ENTRY_SAMPLE


@pytest.fixture(scope="module")
def train_entry(entry_table, tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """The quickstart's entry, refusing each value of ``entry_table``: {override: (expected, result)}."""
    tmp_path = tmp_path_factory.mktemp("train_entry")
    report = _run_entry(
        "examples.simple_math.train",
        [override for override, _ in entry_table],
        [f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
    )
    assert not report["ray_started"]
    assert [r["override"] for r in report["results"]] == [override for override, _ in entry_table]
    return {o: (e, r) for (o, e), r in zip(entry_table, report["results"], strict=True)}


@pytest.fixture(scope="module")
def rllm_entry(entry_table, tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """rLLM's entry, refusing each value of ``entry_table``: {override: (expected, result)}.
    rLLM users name the model with tinker's model.name; a bad one is reported under model.path."""
    tmp_path = tmp_path_factory.mktemp("rllm_entry")
    report = _run_entry(
        "examples.simple_math.train_with_rllm",
        [override.replace("model.path=", "model.name=") for override, _ in entry_table],
        ["rllm/backend=skyrl", "model.name=tiny", f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
    )
    assert not report["ray_started"]
    return {o: (e, r) for (o, e), r in zip(entry_table, report["results"], strict=True)}


def _assert_entry_refuses(entry: dict[str, tuple[str, dict]], table: list[tuple[str, str]]) -> None:
    assert {override for override, _ in table} <= set(entry)
    for override, _ in table:
        expected, result = entry[override]
        _assert_one_line(result["stderr"], expected, result["code"])


@pytest.mark.slow
def test_train_entry_refuses_in_one_line_before_ray(train_entry):
    _assert_entry_refuses(train_entry, ENTRY_SAMPLE)


@pytest.mark.slow
def test_train_entry_refuses_the_whole_table_in_one_line_before_ray(train_entry):
    _assert_entry_refuses(train_entry, BAD)


requires_rllm = pytest.mark.skipif(importlib.util.find_spec("rllm") is None, reason="rLLM is not installed")


@pytest.mark.slow
@requires_rllm
def test_rllm_entry_refuses_in_one_line_before_ray(rllm_entry):
    _assert_entry_refuses(rllm_entry, ENTRY_SAMPLE)


@requires_rllm
@pytest.mark.slow
def test_rllm_entry_refuses_the_whole_table_in_one_line_before_ray(rllm_entry):
    _assert_entry_refuses(rllm_entry, BAD)


@pytest.mark.slow
def test_train_sh_prints_one_line(tmp_path):
    result = subprocess.run(
        ["bash", "scripts/train.sh", "training.learning_rate=-1", f"hydra.run.dir={tmp_path}/run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    _assert_one_line(result.stderr, "training.learning_rate=-1: expected a number > 0", result.returncode)


@pytest.mark.slow
def test_a_ray_address_nothing_answers_is_one_line_before_ray(tmp_path, monkeypatch):
    """A stale RAY_ADDRESS (its cluster gone): one line at once, where Ray would retry for minutes."""
    with socket.socket() as closed:  # bound, not listening: connections to it are refused
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        report = _run_entry(
            "examples.simple_math.train",
            ["rllm.trainer.total_batches=1"],
            [f"hydra.run.dir={tmp_path}/run", f"training.default_local_dir={tmp_path}/ckpt"],
            tmp_path,
        )
    assert not report["ray_started"]
    [result] = report["results"]
    _assert_one_line(result["stderr"], f"RAY_ADDRESS={address}: no Ray cluster answers there", result["code"])
    assert "unset RAY_ADDRESS" in result["stderr"]
