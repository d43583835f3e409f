"""Launcher: the placement plan (in process and from the CLI), and training across a 2-node Ray cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import PAIRS, descendants, hf_logprobs, reap, sft_batch, skyrl_overrides, wait_until

from rllm_skyrl import compat
from rllm_skyrl.cli import main, plan
from rllm_skyrl.hardware import Platform


def test_plan_shows_placement_and_resolved_config_without_starting_anything():
    import ray

    was_running = ray.is_initialized()
    text = plan(
        [
            "model.path=org/some-8b-model",
            "rllm.algorithm.adv_estimator=gae",
            "skyrl.trainer.placement.policy_num_gpus_per_node=8",
            "skyrl.trainer.placement.critic_num_gpus_per_node=4",
            "inference.urls=[http://10.0.0.5:8000,http://10.0.0.6:8000]",
        ],
        config_dir=str(Path(__file__).resolve().parent.parent / "config"),
    )
    assert "policy: 1 node(s) x 8 GPU(s) = 8 training GPU(s)" in text
    assert "critic: 1 node(s) x 4 GPU(s) = 4 training GPU(s)" in text
    assert "inference: 2 engine(s) at" in text
    assert "total training GPUs: 12" in text
    # The GPU view: CPU-only overrides are not applied to a cluster plan.
    assert "flash_attn: true" in text
    assert "path: org/some-8b-model" in text
    assert ray.is_initialized() == was_running


def _patch_sets(text: str, platform: str) -> tuple[list[str], list[str]]:
    """The plan's list for ``platform``: (SkyRL's training code, the driver process) lines."""
    (section,) = [part for part in text.split("\n\n") if part.startswith(f"# patch sets on {platform}:")]
    lines = section.splitlines()[1:]
    split = next(i for i, line in enumerate(lines) if line.startswith("the driver process"))
    return [line.strip() for line in lines[1:split]], [line.strip() for line in lines[split + 1 :]]


def test_plan_lists_the_patch_sets_of_the_gpu_cluster_and_of_this_cpu_machine():
    """On CUDA SkyRL's training code gets only bug fixes; the driver-side sets are listed apart,
    saying why they apply there too. A CPU machine's run adds its enablement and speed sets."""
    overrides = ["model.path=org/some-8b-model"]
    text = plan(overrides, here=Platform(cuda=False))
    training, driver = _patch_sets(text, "CUDA")
    assert [line.split(" ")[0] for line in training] == ["tied_embeddings"]
    assert all("(bug fix)" in line for line in training)
    # which sets these are is test_compat's to pin; here, that plan prints them, in the table's order
    gpu = Platform.gpu_cluster()
    driver_sets = [p.name for p in compat.on_platform(gpu) if not p.training_path]
    assert [line.split(" ")[0] for line in driver] == driver_sets
    assert "SkyRL's training code untouched" in text and "backend='skyrl'" in text
    training, driver = _patch_sets(text, "CPU")
    assert [line.split(" ")[0] for line in training] == [
        *compat.for_platform(Platform(cuda=False)),
        "local_ray",
        "rllm_metrics_table",
    ]
    assert "response_logits (speed): the LM head over the response window only" in text
    assert [line.split(" ")[0] for line in driver] == driver_sets
    on_a_gpu_machine = plan(overrides, here=gpu)
    assert "# patch sets on CUDA:" in on_a_gpu_machine and "# patch sets on CPU:" not in on_a_gpu_machine


def test_rllm_skyrl_plan_from_the_command_line():
    """The installed console script runs ``launcher.main``: ``plan`` prints the plan, exits 0, and
    nothing else (SkyRL's import-time notes, such as its vLLM patches skipped here, stay quiet)."""
    script = Path(sys.executable).parent / "rllm-skyrl"
    result = subprocess.run(
        [str(script), "plan", "model.path=org/some-8b-model", "rllm.algorithm.kl_beta=0.01"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "policy: 1 node(s) x 1 GPU(s) = 1 training GPU(s)" in result.stdout
    assert "ref: 1 node(s) x 1 GPU(s)" in result.stdout  # the KL term brings a reference model
    assert "use_kl_loss: true" in result.stdout and "path: org/some-8b-model" in result.stdout
    assert "# patch sets on CUDA: the GPU cluster this plan is for" in result.stdout
    assert "# patch sets on CPU: this machine" in result.stdout  # the test machine has no GPU
    assert result.stderr == ""


def test_cli_refuses_a_missing_or_unknown_command(capsys):
    for argv in ([], ["serve"], ["train"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: command" in err
    assert "invalid choice: 'serve'" in err
    assert "rllm-skyrl train: error: the following arguments are required: --agent, --evaluator" in err


TWO_NODE_APP = Path(__file__).resolve().parent / "apps" / "two_node_step.py"


def start_ray_node(ray_bin: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    """``ray start --block`` in its own session: the node lives exactly as long as this process."""
    return subprocess.Popen(
        [ray_bin, "start", "--block", "--node-ip-address=127.0.0.1", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_ray_nodes(nodes: list[subprocess.Popen]) -> list[int]:
    """Stop the nodes this test started, and every process they started; nothing else."""
    tree = [p for node in nodes for p in descendants(node.pid)]
    for node in reversed(nodes):  # the worker node first, then the head
        if node.poll() is None:
            node.terminate()  # ``ray start --block`` stops its node's processes on SIGTERM
    for node in reversed(nodes):
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()
    return reap(tree, timeout=30)


@pytest.mark.slow  # starts a second Ray node: about 40 s
@pytest.mark.timeout(600)
def test_training_step_runs_across_two_ray_nodes(tiny_model_dir, tiny_tokenizer, tmp_path):
    """A head node (``--port=0``: Ray takes a free port and reports it) plus a second node on
    loopback; one policy rank per node; the step's loss is the batch's summed cross-entropy."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rc")  # Ray's socket paths must stay short
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    resources = ["--num-cpus=2", "--num-gpus=1", "--disable-usage-stats"]
    nodes: list[subprocess.Popen] = []
    try:
        head_args = ["--head", "--port=0", f"--temp-dir={temp_dir}", "--include-dashboard=false"]
        nodes.append(start_ray_node(ray_bin, env, *head_args, *resources))
        address_file = Path(temp_dir) / "ray_current_cluster"

        def head_port() -> str | None:
            assert nodes[0].poll() is None, f"the head node exited with {nodes[0].returncode}"
            return address_file.read_text().strip().rpartition(":")[2] if address_file.exists() else None

        # Ray writes the head's address with the machine's IP; the test connects through loopback.
        address = f"127.0.0.1:{wait_until(head_port, 120, 'the head node to write its address')}"
        nodes.append(start_ray_node(ray_bin, env, f"--address={address}", *resources))
        result = subprocess.run(
            [
                sys.executable,
                str(TWO_NODE_APP),
                json.dumps(skyrl_overrides(tiny_model_dir, tmp_path)),
                json.dumps(PAIRS),
            ],
            env={**env, "RAY_ADDRESS": address},
            capture_output=True,
            text=True,
            timeout=480,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        leftovers = stop_ray_nodes(nodes)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert report["cluster_nodes"] == 2
    assert len(set(report["nodes"])) == 2, f"both ranks landed on one node: {report['nodes']}"
    _, prompts, responses = sft_batch(tiny_tokenizer, PAIRS)
    expected_loss = -sum(float(lp.sum()) for lp in hf_logprobs(tiny_model_dir, prompts, responses))
    assert report["loss"] == pytest.approx(expected_loss, rel=1e-4)
    assert report["grad_norm"] > 0
    assert leftovers == [], f"processes of the test's Ray nodes outlived them: {leftovers}"
