"""A thin facade over SkyRL's ``WorkerDispatch``: start the actor groups, then train.

Callers say "forward_backward on the policy" and get SkyRL's ``WorkerOutput``
back; meshes, sharding, gathering and colocation stay SkyRL's business. What this
layer adds is bring-up from a config (actor groups for policy, and optionally
critic and ref, on whatever Ray this process is connected to) and a clean
shutdown that leaves no actor behind.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from rllm_skyrl.compat import cpu

logger = logging.getLogger(__name__)

ROLES = ("policy", "critic", "ref")


def make_skyrl_config(overrides: dict[str, Any] | list[str] | None = None, for_cpu: bool | None = None):
    """Build a typed ``SkyRLTrainConfig`` from dotted overrides, with the CPU settings forced when needed.

    On a machine without CUDA the CPU overrides win over the caller's: SkyRL cannot
    run with them otherwise, and a silent wrong value would fail much later. ``for_cpu``
    overrides the detection (``plan`` resolves a GPU cluster's config from a laptop).
    """
    from skyrl.train.config.config import SkyRLTrainConfig

    if isinstance(overrides, list):
        from omegaconf import OmegaConf

        overrides = {k: v for k, v in OmegaConf.to_container(OmegaConf.from_dotlist(overrides)).items()}
        overrides = _flatten(overrides)
    merged = dict(overrides or {})
    if (not cpu.cuda_available()) if for_cpu is None else for_cpu:
        merged.update(cpu.CPU_CONFIG_OVERRIDES)
    for key in merged:
        _check_key(SkyRLTrainConfig, key)
    return SkyRLTrainConfig.from_cli_overrides(merged)


def _check_key(config_cls: type, key: str) -> None:
    """Name the whole dotted key when it is not in SkyRL's config (SkyRL names only the leaf)."""
    import dataclasses
    import typing

    node: Any = config_cls
    for depth, part in enumerate(key.split(".")):
        if not dataclasses.is_dataclass(node):
            return  # a dict-valued field (e.g. model_config_kwargs): free-form below this point
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            where = ".".join(key.split(".")[:depth]) or "the top level"
            raise ValueError(
                f"unknown SkyRL config key {key!r}: {where} has no field {part!r}; "
                f"its fields are {sorted(fields)}"
            )
        hint = typing.get_type_hints(node).get(part)
        candidates = [hint, *typing.get_args(hint)]
        node = next((c for c in candidates if dataclasses.is_dataclass(c)), None)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


class SkyRLWorkers:
    """Policy (and optional critic / ref) FSDP actor groups behind one ``WorkerDispatch``.

    Ray must already be initialised (see ``rllm_skyrl.launcher.start_ray``).
    """

    def __init__(self, cfg, tokenizer, total_training_steps: int | None = None):
        from skyrl.backends.skyrl_train.workers.worker import PPORayActorGroup
        from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch

        if not ray.is_initialized():
            raise RuntimeError("Ray is not running; call rllm_skyrl.launcher.start_ray(cfg) first.")
        if cfg.trainer.strategy != "fsdp":
            raise ValueError(f"trainer.strategy={cfg.trainer.strategy!r} is not supported; use 'fsdp'.")
        if cfg.trainer.placement.colocate_all:
            raise ValueError(
                "trainer.placement.colocate_all=true is not supported yet: training and inference run on "
                "separate devices; set skyrl.trainer.placement.colocate_all=false"
            )
        cpu.apply()
        from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import CriticWorker, PolicyWorker, RefWorker

        self.cfg = cfg
        self.tokenizer = tokenizer
        placement = cfg.trainer.placement
        algo = cfg.trainer.algorithm
        use_ref = algo.use_kl_loss or algo.use_kl_in_reward
        use_critic = bool(cfg.trainer.critic.model.path)

        worker_classes = {"policy": PolicyWorker, "critic": CriticWorker, "ref": RefWorker}
        roles = ["policy"] + (["critic"] if use_critic else []) + (["ref"] if use_ref else [])
        self._groups: dict[str, PPORayActorGroup] = {}
        try:
            for role in roles:
                self._groups[role] = PPORayActorGroup(
                    cfg.trainer,
                    getattr(placement, f"{role}_num_nodes"),
                    getattr(placement, f"{role}_num_gpus_per_node"),
                    worker_classes[role],
                    pg=None,
                    num_gpus_per_actor=1,
                    colocate_all=False,
                    sequence_parallel_size=getattr(cfg.trainer, role).sequence_parallel_size,
                )
            self._init_models(total_training_steps)
        except BaseException:
            self.shutdown()
            raise
        self.dispatch = WorkerDispatch(
            cfg,
            policy_actor_group=self._groups["policy"],
            critic_actor_group=self._groups.get("critic"),
            ref_actor_group=self._groups.get("ref"),
        )

    def _init_models(self, total_training_steps: int | None) -> None:
        """Load weights and build optimizers; SkyRL's schedulers count optimizer steps, not batches."""
        trainer = self.cfg.trainer
        refs = []
        for role, group in self._groups.items():
            model_cfg = getattr(trainer, role).model
            if role == "ref":
                refs.extend(group.async_init_model(model_cfg.path))
            else:
                refs.extend(group.async_init_model(model_cfg.path, num_training_steps=total_training_steps))
        ray.get(refs)
        pad_id = self.tokenizer.pad_token_id
        for role in ("policy", "critic"):
            if role in self._groups:
                ray.get(self._groups[role].async_run_ray_method("pass_through", "_set_pad_token_id", pad_id))

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def dp_size(self, role: str = "policy") -> int:
        return self.dispatch.dp_size(role)

    def forward(self, role: str, batch, loss_fn: str | None = None, loss_fn_config: dict | None = None, **kw):
        return self.dispatch.forward(role, batch, loss_fn=loss_fn, loss_fn_config=loss_fn_config, **kw)

    def forward_backward(
        self, role: str, batch, loss_fn: str | None = None, loss_fn_config: dict | None = None, **kw
    ):
        return self.dispatch.forward_backward(
            role, batch, loss_fn=loss_fn, loss_fn_config=loss_fn_config, **kw
        )

    def optim_step(self, role: str = "policy") -> float | None:
        return self.dispatch.optim_step(role)

    def set_lr(self, role: str, learning_rate: float) -> None:
        self.dispatch.set_lr(role, learning_rate)

    def set_algorithm_config(self, role: str, **kwargs) -> None:
        self.dispatch.set_algorithm_config(role, **kwargs)

    def save_hf_model(self, role: str, export_dir: str) -> None:
        self.dispatch.save_hf_model(role, export_dir, self.tokenizer)

    def save_checkpoint(self, role: str, ckpt_dir: str) -> None:
        self.dispatch.save_checkpoint(role, ckpt_dir, tokenizer=self.tokenizer)

    def load_checkpoint(self, role: str, ckpt_dir: str, load_optimizer_states: bool = True) -> None:
        self.dispatch.load_checkpoint(
            role,
            ckpt_dir,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_optimizer_states,
        )

    def shutdown(self) -> None:
        """Kill every actor we started; the Ray runtime itself belongs to the launcher."""
        for group in self._groups.values():
            for actor in getattr(group, "_actor_handlers", []):
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # already dead: nothing left to release
                    pass
        self._groups.clear()
