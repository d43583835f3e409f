"""Launcher: the placement plan without starting anything, and training across a 2-node Ray cluster."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from rllm_skyrl.launcher import plan


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


DRIVER = textwrap.dedent(
    """
    import json, sys
    from transformers import AutoTokenizer
    sys.path.insert(0, {test_dir!r})
    from test_workers_cpu import PAIRS, config, sft_batch
    from rllm_skyrl.runtime import start_ray
    from rllm_skyrl.workers import SkyRLWorkers
    from pathlib import Path

    model_dir = {model_dir!r}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = config(model_dir, Path({tmp!r}), **{{"trainer.placement.policy_num_nodes": 2}})
    start_ray(cfg)
    import ray
    workers = SkyRLWorkers(cfg, tokenizer)
    batch, _, _ = sft_batch(tokenizer, PAIRS)
    loss = workers.forward_backward("policy", batch, loss_fn="cross_entropy").metrics["loss"]
    grad_norm = workers.optim_step("policy")
    print(json.dumps({{"nodes": workers.dispatch.get_node_ids(), "cluster_nodes": len(ray.nodes()),
                       "loss": loss, "grad_norm": grad_norm}}))
    workers.shutdown()
    """
)


@pytest.mark.timeout(600)
def test_training_step_runs_across_two_ray_nodes(tiny_model_dir, tmp_path):
    """`ray start --head` plus a second `ray start --address` on loopback; one policy rank per node."""
    ray_bin = str(Path(sys.executable).parent / "ray")
    temp_dir = tempfile.mkdtemp(prefix="/tmp/rc")  # Ray's socket paths must stay short
    port = _free_port()
    env = {**os.environ, "RAY_ADDRESS": ""}
    env.pop("RAY_ADDRESS")
    common = ["--num-cpus=2", "--num-gpus=1", "--disable-usage-stats"]
    try:
        subprocess.run(
            [
                ray_bin,
                "start",
                "--head",
                f"--port={port}",
                "--node-ip-address=127.0.0.1",
                f"--temp-dir={temp_dir}",
                "--include-dashboard=false",
                *common,
            ],
            check=True,
            env=env,
            capture_output=True,
            timeout=120,
        )
        subprocess.run(
            [ray_bin, "start", f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1", *common],
            check=True,
            env=env,
            capture_output=True,
            timeout=120,
        )
        script = DRIVER.format(
            test_dir=str(Path(__file__).parent), model_dir=tiny_model_dir, tmp=str(tmp_path)
        )
        result = subprocess.run(
            [sys.executable, "-c", script],
            env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
            capture_output=True,
            text=True,
            timeout=480,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        assert report["cluster_nodes"] == 2
        assert len(set(report["nodes"])) == 2, f"both ranks landed on one node: {report['nodes']}"
        assert report["loss"] > 0 and report["grad_norm"] > 0
    finally:
        # Stop only this cluster's processes: `ray stop` would also stop the suite's shared Ray.
        subprocess.run(["pkill", "-f", temp_dir], check=False)
        subprocess.run(["pkill", "-f", f"127.0.0.1:{port}"], check=False)
        shutil.rmtree(temp_dir, ignore_errors=True)
