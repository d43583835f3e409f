"""The CUDA path, checked without a GPU: placement plans, the platform's decisions, SkyRL's own
config validation, and the calls into SkyRL checked against its real signatures (so the fakes used
here cannot drift from SkyRL)."""

from __future__ import annotations

import ast
import asyncio
import copy
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

from rllm_skyrl import runtime as runtime_module
from rllm_skyrl.cli import plan
from rllm_skyrl.hardware import Platform
from rllm_skyrl.rollout import servers as rollout_servers
from rllm_skyrl.rollout.servers import start_servers
from rllm_skyrl.run_config import ConfigError
from rllm_skyrl.update.workers import COLOCATED_GPU_SHARE, SkyRLWorkers

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = str(REPO / "config")
MODEL = "model.path=org/some-model"
PLACEMENT = "skyrl.trainer.placement."
ENGINES = "++skyrl.generator.inference_engine."


@pytest.fixture(autouse=True)
def no_wandb_key(monkeypatch):
    """SkyRL's validation demands a W&B key when its own logger is wandb; ours is not."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


PLANS = {
    "1 GPU: trainer and vLLM colocated": (
        [f"{PLACEMENT}colocate_all=true"],
        ["policy: 1 node(s) x 1 GPU(s)", "weight transfer: CUDA IPC", "GPUs needed: 1"],
    ),
    "2 GPUs: trainer 1, vLLM 1": (
        [],
        ["inference: 1 vLLM engine(s) x 1 GPU(s) = 1 GPU(s)", "weight transfer: NCCL", "GPUs needed: 2"],
    ),
    "8 GPUs: trainer 4, vLLM 4": (
        [f"{PLACEMENT}policy_num_gpus_per_node=4", "inference.num_engines=4"],
        ["policy: 1 node(s) x 4 GPU(s) = 4 training GPU(s)", "GPUs needed: 8"],
    ),
    "8 GPUs colocated, vLLM tensor-parallel 2": (
        [
            f"{PLACEMENT}colocate_all=true",
            f"{PLACEMENT}policy_num_gpus_per_node=8",
            "inference.num_engines=4",
            f"{ENGINES}tensor_parallel_size=2",
        ],
        ["inference: 4 vLLM engine(s) x 2 GPU(s) = 8 GPU(s)", "weight transfer: CUDA IPC", "GPUs needed: 8"],
    ),
    "8 GPUs, PPO: policy 2, critic 2, ref 2, vLLM 2": (
        [
            "rllm.algorithm.adv_estimator=gae",
            "rllm.algorithm.kl_beta=0.01",
            f"{PLACEMENT}policy_num_gpus_per_node=2",
            f"{PLACEMENT}critic_num_gpus_per_node=2",
            f"{PLACEMENT}ref_num_gpus_per_node=2",
            "inference.num_engines=2",
        ],
        ["critic: 1 node(s) x 2 GPU(s)", "ref: 1 node(s) x 2 GPU(s)", "GPUs needed: 8"],
    ),
    "2 nodes x 8 GPUs colocated": (
        [
            f"{PLACEMENT}colocate_all=true",
            f"{PLACEMENT}policy_num_nodes=2",
            f"{PLACEMENT}policy_num_gpus_per_node=8",
            "inference.num_engines=16",
        ],
        ["policy: 2 node(s) x 8 GPU(s) = 16 training GPU(s)", "GPUs needed: 16"],
    ),
    "2 nodes: trainer on 8, vLLM on 8": (
        [f"{PLACEMENT}policy_num_gpus_per_node=8", "inference.num_engines=8"],
        ["policy: 1 node(s) x 8 GPU(s)", "8 vLLM engine(s)", "GPUs needed: 16"],
    ),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_plan_validates_with_skyrl_and_counts_the_gpus(name):
    overrides, expected = PLANS[name]
    text = plan([MODEL, *overrides], config_dir=CONFIG_DIR)
    summary = text.split("# resolved SkyRL config")[0]
    missing = [line for line in expected if line not in summary]
    assert not missing, f"{name}: {missing} not in\n{summary}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [f"{PLACEMENT}colocate_all=true", "inference.num_engines=2"],
            "num_policy_gpus \\(1\\) and num_rollout_gpus \\(2\\) must be the same",
        ),
        ([f"{PLACEMENT}policy_num_gpus_per_node=3"], "divisible"),
    ],
    ids=["colocated engines outnumber trainer GPUs", "batch not divisible by data-parallel size"],
)
def test_plan_refuses_what_skyrl_would_refuse(overrides, message):
    with pytest.raises(ConfigError, match=f"SkyRL rejects this config.*{message}"):
        plan([MODEL, *overrides], config_dir=CONFIG_DIR)


@pytest.mark.parametrize(
    "platform",
    [Platform(cuda=True, flash_attn=True), Platform(cuda=True, flash_attn=False), Platform(cuda=False)],
    ids=["cuda-flash-attn", "cuda-sdpa", "cpu"],
)
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_resolved_config_passes_skyrls_validation(platform, estimator):
    from hydra import compose, initialize_config_dir
    from skyrl.train.utils.utils import validate_cfg

    from rllm_skyrl.run_config import resolve_run_config

    overrides = [MODEL, f"rllm.algorithm.adv_estimator={estimator}"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose("unified", overrides=overrides)
    run = resolve_run_config(cfg, platform=platform, resolve_models=False)
    trainer = run.skyrl.trainer
    assert trainer.logger == "console"
    assert trainer.flash_attn is platform.flash_attn
    assert trainer.remove_microbatch_padding is platform.flash_attn  # packing needs flash-attn
    validate_cfg(copy.deepcopy(run.skyrl))


@pytest.mark.parametrize(
    ("platform", "urls", "kind", "sync"),
    [
        (Platform(cuda=True, flash_attn=True), None, "skyrl_vllm", "skyrl"),
        (Platform(cuda=True, flash_attn=False), None, "skyrl_vllm", "skyrl"),
        (Platform(cuda=True), ["http://10.0.0.5:8000"], "external", "skyrl"),
        (Platform(cuda=False), None, "cpu_transformers", "disk"),
        (Platform(cuda=False), ["http://127.0.0.1:8000"], "external", "disk"),
    ],
)
def test_platform_picks_servers_and_weight_sync(platform, urls, kind, sync):
    assert platform.server_kind(urls) == kind
    assert platform.weight_sync_method() == sync


def test_this_machine_is_the_cpu_platform():
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs CUDA to be absent")
    detected = Platform.detect()
    assert detected == Platform(cuda=False) and detected.ray_resources()["num_gpus"] > 0
    assert Platform(cuda=True).ray_resources() == {}  # Ray counts real GPUs


# --------------------------------------------------------------------------- SkyRL's signatures


class Recording:
    """A stand-in for a SkyRL object: every call is bound to the real method's signature first."""

    def __init__(self, real_cls: type, calls: list):
        self._real_cls, self._calls = real_cls, calls

    def __getattr__(self, name):
        real = getattr(self._real_cls, name)  # AttributeError if SkyRL has no such method
        signature = inspect.signature(real)

        def call(*args, **kwargs):
            signature.bind(self, *args, **kwargs)
            self._calls.append((name, args, kwargs))
            if inspect.iscoroutinefunction(real):
                return asyncio.sleep(0)
            return [] if name.startswith("async_") else None

        return call


def test_connect_inference_and_sync_call_skyrls_dispatch_as_it_defines_them():
    from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch

    calls: list = []
    workers = object.__new__(SkyRLWorkers)
    workers.dispatch = Recording(WorkerDispatch, calls)
    workers.connect_inference("client")
    asyncio.run(workers.save_weights_for_sampler())
    assert calls == [
        ("set_inference_engine_client", ("client",), {}),  # without it SkyRL's sync raises
        ("init_weight_sync_state", ("client",), {}),
        ("save_weights_for_sampler", (), {}),
    ]


@pytest.mark.parametrize("colocated", [False, True], ids=["separate", "colocated"])
def test_actor_groups_are_built_as_skyrls_trainer_builds_them(monkeypatch, colocated, tiny_tokenizer):
    """Arguments to SkyRL's PPORayActorGroup and WorkerDispatch, bound to their real signatures."""
    from skyrl.backends.skyrl_train.workers import worker, worker_dispatch

    from rllm_skyrl.run_config import make_skyrl_config
    from rllm_skyrl.update import workers as workers_module

    calls: list = []
    real_group = worker.PPORayActorGroup

    def group(*args, **kwargs):
        inspect.signature(real_group).bind(*args, **kwargs)
        calls.append(("PPORayActorGroup", args, kwargs))
        return Recording(real_group, calls)

    def dispatch(*args, **kwargs):
        inspect.signature(worker_dispatch.WorkerDispatch).bind(*args, **kwargs)
        calls.append(("WorkerDispatch", args, kwargs))

    monkeypatch.setattr(worker, "PPORayActorGroup", group)
    monkeypatch.setattr(worker_dispatch, "WorkerDispatch", dispatch)
    monkeypatch.setattr(workers_module.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(workers_module.ray, "get", lambda refs: refs)
    monkeypatch.setattr(
        "skyrl.backends.skyrl_train.utils.ppo_utils.sync_registries",
        lambda: calls.append(("sync_registries",)),
    )
    cfg = make_skyrl_config(
        {
            "trainer.policy.model.path": "m",
            "trainer.placement.colocate_all": colocated,
            "trainer.algorithm.use_kl_loss": False,
        },
        platform=Platform(cuda=True, flash_attn=False),
    )
    pg = object() if colocated else None
    SkyRLWorkers(cfg, tiny_tokenizer, platform=Platform(cuda=True, flash_attn=False), placement_group=pg)
    (_, _, group_kwargs) = next(call for call in calls if call[0] == "PPORayActorGroup")
    assert group_kwargs["pg"] is pg
    assert group_kwargs["colocate_all"] is colocated
    assert group_kwargs["num_gpus_per_actor"] == (COLOCATED_GPU_SHARE if colocated else 1)
    assert [name for name, *_ in calls] == [
        "PPORayActorGroup",
        "sync_registries",  # after the actors exist, before they look a loss up
        "async_init_model",
        "WorkerDispatch",
        "async_run_ray_method",  # the tokenizer's pad id (use_tokenizer)
    ]


def test_skyrls_server_start_takes_the_shared_placement_group():
    """``build_new_inference_client(cfg, tokenizer, placement_group=...)``, read from SkyRL's source
    (importing it needs vllm-router, a GPU-extra package)."""
    import importlib.util

    spec = importlib.util.find_spec("skyrl.backends.skyrl_train.inference_servers.setup")
    tree = ast.parse(Path(spec.origin).read_text())
    function = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name == "build_new_inference_client"
    )
    assert [arg.arg for arg in function.args.args] == ["cfg", "tokenizer", "placement_group"]


def test_colocated_placement_group_is_the_one_skyrls_trainer_builds():
    """``rollout_servers.colocated_placement_group`` repeats SkyRL's ``BasePPOExp.get_colocate_pg``."""
    from skyrl.train.entrypoints.main_base import BasePPOExp

    skyrl_source = inspect.getsource(BasePPOExp.get_colocate_pg)
    ours = inspect.getsource(rollout_servers.colocated_placement_group)
    for fragment in ('{"GPU": 1, "CPU": 1}', 'strategy="PACK"', "tensor_parallel_size", "data_parallel_size"):
        assert fragment in skyrl_source and fragment in ours, fragment


def test_colocated_servers_must_be_skyrls_own():
    run = stand_in_run(Platform(cuda=True), colocated=True, inference=SimpleNamespace(urls=("http://h:1",)))
    with pytest.raises(ValueError, match="colocate_all=true needs SkyRL's vLLM servers.*drop inference.urls"):
        start_servers(run, tokenizer=None)


def stand_in_run(platform: Platform, colocated: bool, **fields) -> SimpleNamespace:
    """What ``Runtime.start`` reads of a ``RunConfig``, for one policy worker."""
    placement = SimpleNamespace(colocate_all=colocated)
    return SimpleNamespace(
        platform=platform,
        skyrl=SimpleNamespace(trainer=SimpleNamespace(placement=placement)),
        log_dir=Path("logs"),
        roles=("policy",),
        trained_roles=("policy",),
        optimizer_steps=1,
        cpu_threads=1,
        **fields,
    )


@pytest.mark.parametrize(
    ("platform", "colocated"),
    [(Platform(cuda=True), False), (Platform(cuda=True), True), (Platform(cuda=False), False)],
    ids=["cuda-separate", "cuda-colocated", "cpu"],
)
def test_bring_up_is_ray_then_servers_then_workers_as_skyrls_trainer(monkeypatch, platform, colocated):
    """SkyRL's order (its trainer builds the inference client, then the models): the servers
    (colocated, in the placement group they make), the workers (in the same group), then the wait
    for servers that loaded meanwhile. Shutdown stops what started, servers first."""
    events: list = []
    pg = SimpleNamespace(pg="raw-pg")

    class Lock:
        def release(self):
            events.append("checkpoints released")

    monkeypatch.setattr(
        runtime_module,
        "claim_checkpoints",
        lambda settings, roles: events.append(("checkpoints", roles)) or ("manager", Lock()),
    )
    monkeypatch.setattr(runtime_module, "start_ray", lambda *a, **k: events.append("ray") or True)
    monkeypatch.setattr(runtime_module, "load_tokenizer", lambda path: events.append("tokenizer") or "tok")

    class Servers:
        placement_group = pg if colocated else None

        def wait_ready(self):
            events.append("servers ready")

        def stop(self):
            events.append("servers stopped")

    monkeypatch.setattr(
        runtime_module,
        "start_servers",
        lambda run, tok: events.append(("servers", tok)) or Servers(),
    )

    class Workers:
        def __init__(self, cfg, tokenizer, placement_group=None, **kwargs):
            events.append(("workers", tokenizer, placement_group))

        def shutdown(self):
            events.append("workers stopped")

    class Models:
        def __init__(self, workers):
            pass

    class Engine:
        client = "client"

        @classmethod
        def for_servers(cls, servers, tokenizer, run):
            events.append(("engine", tokenizer))
            return cls()

    monkeypatch.setattr(runtime_module, "SkyRLWorkers", Workers)
    monkeypatch.setattr(runtime_module, "ModelRegistry", Models)
    monkeypatch.setattr(runtime_module, "SkyRLEngine", Engine)
    monkeypatch.setattr(runtime_module.weight_sync, "prepare", lambda *a: events.append("weight sync"))
    monkeypatch.setattr(runtime_module, "stop_ray", lambda: events.append("ray stopped"))
    monkeypatch.setattr(runtime_module.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(
        runtime_module, "remove_placement_group", lambda raw: events.append(("pg removed", raw))
    )
    run = stand_in_run(
        platform,
        colocated,
        checkpoint="settings",
        model_path="model-dir",
        inference=SimpleNamespace(urls=None),
        lora=SimpleNamespace(enabled=False),
    )
    runtime = runtime_module.Runtime.start(run)
    group = pg if colocated else None
    assert events == [
        "tokenizer",
        ("checkpoints", ("policy",)),
        "ray",
        ("servers", "tok"),
        ("workers", "tok", group),
        "servers ready",
        ("engine", "tok"),
        "weight sync",
    ]
    assert runtime.owns_ray and runtime.tokenizer == "tok"
    events.clear()
    runtime.shutdown()
    removed = [("pg removed", "raw-pg")] if colocated else []
    assert events == ["servers stopped", "workers stopped", *removed, "ray stopped", "checkpoints released"]


def test_a_failed_ray_start_stops_the_bring_up_and_leaves_a_ray_it_did_not_start(monkeypatch):
    """The error reaches the caller; a Ray that was up before (a test session's, a notebook's) is
    not shut down on the way out, and the checkpoint directory claimed before Ray is released."""
    shut_down: list = []

    def start_ray(*args, **kwargs):
        raise RuntimeError("no Ray today")

    released: list = []

    class Lock:
        def release(self):
            released.append(True)

    monkeypatch.setattr(runtime_module, "claim_checkpoints", lambda settings, roles: ("manager", Lock()))
    monkeypatch.setattr(runtime_module, "stop_ray", lambda: shut_down.append(True))
    monkeypatch.setattr(runtime_module, "start_ray", start_ray)
    never = lambda *a, **k: pytest.fail("workers after a failed Ray")  # noqa: E731
    monkeypatch.setattr(runtime_module, "SkyRLWorkers", never)
    run = stand_in_run(
        Platform(cuda=False), colocated=False, checkpoint="settings", inference=SimpleNamespace(urls=None)
    )
    with pytest.raises(RuntimeError, match="no Ray today"):
        runtime_module.Runtime.start(run, tokenizer="tok")
    assert not shut_down
    assert released == [True]  # the checkpoint directory is free again
