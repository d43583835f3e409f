"""Which servers a run samples from: ``inference.urls`` > SkyRL's vLLM servers on CUDA > our CPU servers.

``start_servers`` is called with each platform and the starters are recorded instead of run (no
GPU here); given URLs are checked against a real server and against a port nobody listens on.
"""

from __future__ import annotations

import socket

import pytest
from helpers import compose_unified

from rllm_skyrl.hardware import Platform
from rllm_skyrl.rollout import servers
from rllm_skyrl.run_config import resolve_run_config

URLS = ["http://10.1.2.3:8000", "http://10.1.2.4:8000"]


def test_server_kind_prefers_given_urls_then_cuda_then_cpu():
    assert Platform(cuda=True).server_kind(URLS) == "external"
    assert Platform(cuda=False).server_kind(tuple(URLS)) == "external"
    assert Platform(cuda=True).server_kind(None) == Platform(cuda=True).server_kind([]) == "skyrl_vllm"
    assert (
        Platform(cuda=False).server_kind(None) == Platform(cuda=False).server_kind(()) == "cpu_transformers"
    )


@pytest.mark.parametrize(
    ("cuda", "overrides", "expected"),
    [
        (True, [f"inference.urls=[{','.join(URLS)}]"], ("external", URLS)),
        (False, [f"inference.urls=[{','.join(URLS)}]"], ("external", URLS)),
        (True, [], ("skyrl_vllm", "org/model")),
        (
            False,
            ["inference.num_engines=2", "inference.max_batch_size=7", "inference.threads=3"],
            ("cpu", "org/model", 2, 7, 3),
        ),
    ],
    ids=["urls-on-cuda", "urls-on-cpu", "cuda", "cpu"],
)
def test_start_servers_starts_what_the_platform_picks(monkeypatch, cuda, overrides, expected):
    started = []
    monkeypatch.setattr(servers, "external_servers", lambda urls: started.append(("external", urls)))
    monkeypatch.setattr(
        servers,
        "start_skyrl_servers",
        lambda cfg, tok, *placement: started.append(("skyrl_vllm", cfg.trainer.policy.model.path)),
    )
    monkeypatch.setattr(
        servers,
        "launch_cpu_servers",
        lambda model, count, **kw: started.append(("cpu", model, count, kw["max_batch_size"], kw["threads"])),
    )
    cfg = compose_unified("model.path=org/model", *overrides)
    run = resolve_run_config(cfg, platform=Platform(cuda=cuda), resolve_models=False)
    servers.start_servers(run, tokenizer=None)
    assert started == [expected]


@pytest.mark.parametrize(
    ("overrides", "server_threads", "worker_threads"),
    [
        ([], 8, 8),  # on-policy, rollouts and training take turns: each gets every core
        (["inference.num_engines=2"], 4, 8),
        (["rllm.algorithm.adv_estimator=gae"], 8, 4),  # the policy and the critic worker share them
        (["rllm.async_training.enable=true", "rllm.async_training.mini_batch_size=1"], 4, 4),
        (["inference.threads=3", "training.cpu_threads=5"], 3, 5),
    ],
    ids=["on-policy", "split", "ppo", "fully-async", "given"],
)
def test_cpu_threads_share_the_cores(monkeypatch, overrides, server_threads, worker_threads):
    """A CPU run gives its servers and its training workers the cores (shared between servers, and
    between workers; halved when rollouts overlap training); a training worker's threads reach it
    through the runtime env."""
    from rllm_skyrl.ray_cluster import runtime_env_for

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = compose_unified("model.path=org/model", *overrides)
    run = resolve_run_config(cfg, platform=Platform(cuda=False), resolve_models=False)
    assert (run.inference.threads, run.cpu_threads) == (server_threads, worker_threads)
    env = runtime_env_for(Platform(cuda=False), run.skyrl, cpu_threads=run.cpu_threads)["env_vars"]
    assert env["OMP_NUM_THREADS"] == str(worker_threads)
    gpu_env = runtime_env_for(Platform(cuda=True), run.skyrl, cpu_threads=run.cpu_threads)["env_vars"]
    assert "OMP_NUM_THREADS" not in gpu_env  # on GPUs Ray's default stands


@pytest.mark.parametrize(
    ("allowed", "limit", "overrides", "threads"),
    [
        (range(4), None, [], (4, 4)),  # taskset / a container's cpuset: its cores, not the machine's
        (range(8), "2", [], (2, 2)),  # OMP_NUM_THREADS caps each process
        (range(8), "2", ["inference.num_engines=8"], (1, 2)),
        (range(8), "2", ["inference.threads=3", "training.cpu_threads=5"], (3, 5)),  # asked for
        (range(8), "junk", [], (8, 8)),
    ],
)
def test_cpu_threads_follow_the_cores_this_process_may_use(monkeypatch, allowed, limit, overrides, threads):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(allowed))
    if limit is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", limit)
    cfg = compose_unified("model.path=org/model", *overrides)
    run = resolve_run_config(cfg, platform=Platform(cuda=False), resolve_models=False)
    assert (run.inference.threads, run.cpu_threads) == threads


def test_training_threads_are_split_between_every_worker_on_a_node():
    """Each role's ranks on a node are separate worker processes, each with its own threads."""
    from types import SimpleNamespace

    from rllm_skyrl.run_config.resolve import _workers_per_node

    gpus = {"policy_num_gpus_per_node": 2, "critic_num_gpus_per_node": 1, "ref_num_gpus_per_node": 1}
    placement = SimpleNamespace(**gpus)
    cfg = SimpleNamespace(trainer=SimpleNamespace(placement=placement))
    assert _workers_per_node(cfg, ("policy",)) == 2
    assert _workers_per_node(cfg, ("policy", "critic", "ref")) == 4


def test_given_urls_are_checked_before_use(cpu_server):
    group = servers.external_servers([cpu_server.url])
    assert group.urls == [cpu_server.url] and not group.owned  # someone else's: never stopped here
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(
            RuntimeError, match=f"inference server {dead} is not reachable.*check inference.urls"
        ):
            servers.external_servers([cpu_server.url, dead])
    with pytest.raises(ValueError, match="inference.urls is empty"):
        servers.external_servers([])


@pytest.mark.parametrize(
    ("cuda", "overrides", "expected"),
    [
        (False, [], False),  # CPU: the weights stay gathered from the forward to the backward
        (True, [], True),  # GPU: SkyRL's default, memory for a second copy is scarce
        (False, ["skyrl.trainer.policy.fsdp_config.reshard_after_forward=true"], True),
    ],
    ids=["cpu", "cuda", "given"],
)
def test_trained_models_reshard_after_forward_only_where_memory_is_scarce(cuda, overrides, expected):
    cfg = compose_unified("model.path=org/model", "rllm.algorithm.adv_estimator=gae", *overrides)
    run = resolve_run_config(cfg, platform=Platform(cuda=cuda), resolve_models=False)
    assert run.skyrl.trainer.policy.fsdp_config.reshard_after_forward is expected
    assert run.skyrl.trainer.critic.fsdp_config.reshard_after_forward is cuda


def test_rays_private_settings_are_the_cpu_heads_only():
    """On CPU the worker computes beside the inference server at the driver's priority (the
    ``local_ray`` head's settings); ``ray.init`` on CUDA gets public arguments only."""
    from rllm_skyrl.compat import local_ray

    assert local_ray.SYSTEM_CONFIG["worker_niceness"] == 0
    for platform in (Platform(cuda=True), Platform(cuda=True, flash_attn=True), Platform(cuda=False)):
        assert not [key for key in platform.ray_init_args() if key.startswith("_")], platform
