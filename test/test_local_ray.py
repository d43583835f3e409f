"""A CPU run's local Ray in a process of its own (``compat.local_ray``): connected to, stopped, gone
with its driver, refused when the run needs another, and Ray's own ``ray.init`` where the set does
not apply. Each Ray runs in a fresh interpreter, apart from the suite's shared one.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from helpers import run_python, wait_until
from omegaconf import OmegaConf

from rllm_skyrl import compat
from rllm_skyrl.compat import local_ray, sigterm
from rllm_skyrl.hardware import Platform


@pytest.mark.slow
def test_start_ray_connects_to_the_launched_ray_with_the_runs_token_and_stops_it():
    """The driver joins the Ray launched at the first line (the same GCS; a Ctrl-C meanwhile is the
    driver's, not the launched process's), its workers get the run's runtime env, a client without
    the token is refused, only the daemons a run uses run, and the runtime's stop leaves no
    process behind."""
    outcome = run_python("""
        import json, os, signal, subprocess, sys
        import psutil, ray
        from rllm_skyrl.compat import local_ray
        from rllm_skyrl.run_config import make_skyrl_config
        from rllm_skyrl.ray_cluster import start_ray
        local = local_ray.launch_for_cpu_run()
        local.address()
        os.kill(local.process.pid, signal.SIGINT)
        owned = start_ray(make_skyrl_config(), cpu_threads=1)

        @ray.remote(num_cpus=0)
        def threads():
            return os.environ.get("OMP_NUM_THREADS"), os.nice(0)

        gcs = ray.get_runtime_context().gcs_address
        omp_threads, niceness = ray.get(threads.remote())
        # one connection attempt: Ray retries a refused client 20 times, a second apart
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        env["RAY_NUM_REDIS_GET_RETRIES"] = "1"
        intruder = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='{gcs}')"],
                                  env=env, capture_output=True, text=True, timeout=120)
        result = {
            "owned": owned, "same_ray": gcs == local.address(),
            "threads": omp_threads, "nice": niceness == os.nice(0),
            "cpus": ray.cluster_resources()["CPU"],
            "refused": intruder.returncode != 0 and "Auth" in intruder.stderr,
        }
        descendants = psutil.Process(local.process.pid).children(recursive=True)
        names = {os.path.basename(p.cmdline()[1]) if p.name() == "python" else p.name() for p in descendants}
        # Ray's workers are named ray::<actor class> or ray::IDLE; its two agents too
        result["daemons"] = sorted(n for n in names if not n.startswith("ray::") or n.endswith("Agent"))
        ray.shutdown()
        local_ray.stop()
        gone, alive = psutil.wait_procs(descendants, timeout=30)
        result["left"] = [p.pid for p in alive] + [local.process.pid] * (local.process.poll() is None)
        print(json.dumps(result))
    """)
    assert outcome == {
        "owned": True,
        "same_ray": True,
        "threads": "1",
        "nice": True,  # the worker at the driver's priority (SYSTEM_CONFIG), not Ray's niceness 15
        "cpus": 8.0,
        "refused": True,
        # no dashboard head (dashboard.py), autoscaler monitor (monitor.py) or log monitor
        "daemons": ["gcs_server", "ray::DashboardAgent", "ray::RuntimeEnvAgent", "raylet"],
        "left": [],
    }


@pytest.mark.slow
def test_the_launched_ray_goes_with_a_driver_killed_by_sigkill(tmp_path):
    pids = tmp_path / "pids"
    program = """
        import os, signal, sys
        import psutil
        from rllm_skyrl.compat import local_ray
        local = local_ray.launch({"num_cpus": 1, "include_dashboard": False})
        local.address()
        head = psutil.Process(local.process.pid)
        tree = [head.pid] + [p.pid for p in head.children(recursive=True)]
        open(sys.argv[1], "w").write(" ".join(map(str, tree)))
        os.kill(os.getpid(), signal.SIGKILL)
    """
    driver = subprocess.run([sys.executable, "-c", textwrap.dedent(program), str(pids)], timeout=300)
    assert driver.returncode == -signal.SIGKILL
    tree = [int(pid) for pid in pids.read_text().split()]
    assert len(tree) > 2  # the launched process and Ray's daemons
    wait_until(lambda: not any(_running(pid) for pid in tree), 60, "the launched Ray to stop")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _record_start_ray(monkeypatch, launched=None):
    """``start_ray`` with Ray, the patch sets and the runtime env recorded instead of run."""
    from rllm_skyrl import ray_cluster

    calls = {"stopped": [], "launches": [], "inits": []}

    class Relaunched:
        token = "token"

        def address(self):
            return "10.0.0.2:6379"

    monkeypatch.setattr(local_ray, "launched", lambda: launched)
    monkeypatch.setattr(local_ray, "stop", lambda: calls["stopped"].append(True))
    monkeypatch.setattr(
        local_ray, "launch", lambda init_args: calls["launches"].append(init_args) or Relaunched()
    )
    monkeypatch.setattr(local_ray, "require_token", lambda token=None: "token")
    monkeypatch.setattr(ray_cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_cluster.ray, "init", lambda **kwargs: calls["inits"].append(kwargs))
    monkeypatch.setattr(ray_cluster, "runtime_env_for", lambda *a, **k: {})
    monkeypatch.setattr(ray_cluster.compat, "prepare_driver", lambda platform: [])
    monkeypatch.setattr(sigterm, "apply", lambda: None)
    return ray_cluster, calls


def test_a_launched_ray_the_run_cannot_use_is_stopped_and_another_started(monkeypatch):
    """Launched with the CPU defaults but the run asks for other resources: start_ray stops it,
    launches a Ray with the run's arguments and connects to that one."""

    class Launched:
        init_args = Platform(cuda=False).ray_init_args()

    runtime, calls = _record_start_ray(monkeypatch, Launched())
    assert runtime.start_ray(None, num_cpus=2, platform=Platform(cuda=False)) is True
    assert calls["stopped"] == [True]
    assert calls["launches"] == [Platform(cuda=False).ray_init_args(2)]
    (init,) = calls["inits"]
    assert init["address"] == "10.0.0.2:6379"


def test_rays_own_init_where_the_local_ray_set_does_not_apply(monkeypatch):
    """On CUDA, and on a CPU machine with a Ray the set was not verified on, the run's Ray is
    ``ray.init``'s, with the platform's arguments."""
    monkeypatch.setattr(compat, "_warned", set())
    runtime, calls = _record_start_ray(monkeypatch)
    assert runtime.start_ray(None, platform=Platform(cuda=True, flash_attn=True)) is True
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda name: "2.99.0" if name == "ray" else real(name))
    assert runtime.start_ray(None, platform=Platform(cuda=False)) is True
    assert calls["launches"] == []
    cuda_init, cpu_init = calls["inits"]
    assert "address" not in cuda_init and "num_gpus" not in cuda_init
    assert "_system_config" not in cuda_init  # Ray's private settings: the CPU head's only
    assert cpu_init["num_gpus"] == Platform(cuda=False).ray_init_args()["num_gpus"]


def test_no_ray_is_launched_where_a_gpu_driver_a_cluster_or_another_ray_version_is(monkeypatch):
    monkeypatch.setattr(local_ray, "launch", lambda init_args: pytest.fail("launched"))
    monkeypatch.setattr(local_ray.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    assert local_ray.launch_for_cpu_run() is None
    monkeypatch.setattr(local_ray.os.path, "exists", lambda path: False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert local_ray.launch_for_cpu_run() is None
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(compat, "_warned", set())
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda name: "2.99.0" if name == "ray" else real(name))
    assert local_ray.launch_for_cpu_run() is None


def test_a_run_stops_only_the_ray_it_launched(monkeypatch):
    """A run inside a process whose Ray was launched by someone else (a notebook's, a test suite's
    shared one) leaves that Ray up when it ends; the one it launched itself goes."""
    from rllm_skyrl import training_run

    class Launched:
        def __init__(self):
            self.stopped = False
            self.process = subprocess.Popen(["sleep", "60"])  # running, as long as the test needs

        def stop(self):
            self.stopped = True

    theirs, ours = Launched(), Launched()
    config = OmegaConf.create({"rllm": {"rollout": {"n": 2}}})  # passes the checks made before any start
    monkeypatch.setattr(local_ray, "_launched", theirs)
    monkeypatch.setattr(local_ray, "launch_for_cpu_run", lambda: None)  # Ray is up: nothing launched
    monkeypatch.setattr(training_run, "_train", lambda *args: "run dir")
    assert training_run.train(config, "Workflow") == "run dir"
    assert not theirs.stopped

    monkeypatch.setattr(local_ray, "launch_for_cpu_run", lambda: ours)
    training_run.train(config, "Workflow")
    assert ours.stopped and not theirs.stopped
    assert local_ray.launched() is theirs
    for launched in (theirs, ours):
        launched.process.kill()
