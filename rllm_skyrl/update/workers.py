"""A thin facade over SkyRL's ``WorkerDispatch``: start the actor groups, then train.

Meshes, sharding, gathering and colocation stay SkyRL's business; this layer adds bring-up from a
config (policy, and optionally critic and ref, on whatever Ray this process joined) and a shutdown
that leaves no actor behind.
"""

from __future__ import annotations

from contextlib import suppress

import ray

from rllm_skyrl import compat
from rllm_skyrl.hardware import Platform
from rllm_skyrl.run_config import roles_for

# Share of a GPU each colocated actor asks Ray for, as SkyRL's trainer does (vLLM's actors take
# the same): the bundles of the shared placement group hold trainer and server actors together.
COLOCATED_GPU_SHARE = 0.2


class SkyRLWorkers:
    """Policy (and optional critic / ref) FSDP actor groups behind one ``WorkerDispatch``.

    Ray must already be running. With ``trainer.placement.colocate_all`` the actors go into
    ``placement_group``, the one SkyRL's vLLM servers were started in; SkyRL's dispatch then moves
    models on and off the GPUs, and its weight transfer uses CUDA IPC.
    """

    def __init__(
        self,
        cfg,
        tokenizer,
        total_training_steps: int | None = None,
        roles: tuple[str, ...] | None = None,
        platform: Platform | None = None,
        placement_group=None,
    ):
        compat.prepare_driver(platform or Platform.detect())  # before SkyRL's worker modules are imported
        from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries
        from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import CriticWorker, PolicyWorker, RefWorker
        from skyrl.backends.skyrl_train.workers.worker import PPORayActorGroup
        from skyrl.backends.skyrl_train.workers.worker_dispatch import WorkerDispatch

        if not ray.is_initialized():
            raise RuntimeError("Ray is not running; call rllm_skyrl.runtime.start_ray(...) first.")
        if cfg.trainer.strategy != "fsdp":
            raise ValueError(f"trainer.strategy={cfg.trainer.strategy!r} is not supported; use 'fsdp'.")
        colocated = bool(cfg.trainer.placement.colocate_all)
        if colocated and placement_group is None:
            raise ValueError(
                "trainer.placement.colocate_all=true needs the placement group shared with the vLLM "
                "servers; start the run through rllm_skyrl.runtime.Runtime.start, or set "
                "skyrl.trainer.placement.colocate_all=false"
            )

        self.cfg = cfg
        placement = cfg.trainer.placement
        roles = roles or roles_for(cfg)
        actor_types = {"policy": PolicyWorker, "critic": CriticWorker, "ref": RefWorker}
        self._groups: dict[str, PPORayActorGroup] = {}
        try:
            for role in roles:
                self._groups[role] = PPORayActorGroup(
                    cfg.trainer,
                    getattr(placement, f"{role}_num_nodes"),
                    getattr(placement, f"{role}_num_gpus_per_node"),
                    actor_types[role],
                    pg=placement_group if colocated else None,
                    num_gpus_per_actor=COLOCATED_GPU_SHARE if colocated else 1,
                    colocate_all=colocated,
                    sequence_parallel_size=getattr(cfg.trainer, role).sequence_parallel_size,
                )
            sync_registries()  # functions registered here reach the workers before they look one up
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
        self.use_tokenizer(tokenizer)

    def _init_models(self, total_training_steps: int | None) -> None:
        """Load weights and build optimizers; SkyRL's schedulers count optimizer steps, not batches."""
        refs = []
        for role, group in self._groups.items():
            steps = {} if role == "ref" else {"num_training_steps": total_training_steps}
            refs.extend(group.async_init_model(getattr(self.cfg.trainer, role).model.path, **steps))
        ray.get(refs)

    def use_tokenizer(self, tokenizer) -> None:
        """The tokenizer whose pad id the workers pad with, saved beside HF exports and checkpoints."""
        self.tokenizer = tokenizer
        ray.get(
            [
                ref
                for role in ("policy", "critic")
                if role in self._groups
                for ref in self._groups[role].async_run_ray_method(
                    "pass_through", "_set_pad_token_id", tokenizer.pad_token_id
                )
            ]
        )

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self._groups)

    def dp_size(self, role: str = "policy") -> int:
        return self.dispatch.dp_size(role)

    def forward(self, role: str, batch, **kwargs):
        return self.dispatch.forward(role, batch, **kwargs)

    def forward_backward(self, role: str, batch, **kwargs):
        return self.dispatch.forward_backward(role, batch, **kwargs)

    def optim_step(self, role: str = "policy") -> float | None:
        return self.dispatch.optim_step(role)

    def set_algorithm_config(self, role: str, **kwargs) -> None:
        self.dispatch.set_algorithm_config(role, **kwargs)

    def connect_inference(self, client) -> None:
        """Hand SkyRL's weight transfer the client of the servers it must update (CUDA path)."""
        self.dispatch.set_inference_engine_client(client)
        self.dispatch.init_weight_sync_state(client)

    async def save_weights_for_sampler(self) -> None:
        await self.dispatch.save_weights_for_sampler()

    def broadcast_to_inference_engines(self, client) -> None:
        """The policy workers' own sync into ``client``'s servers, without the GPU transfer set-up: for
        LoRA, rank 0 writes the adapter to ``lora_sync_path`` and calls ``client.load_lora_adapter``."""
        ray.get(
            self._groups["policy"].async_run_ray_method(
                "pass_through", "broadcast_to_inference_engines", client, self.cfg.generator.inference_engine
            )
        )

    def save_hf_model(self, role: str, export_dir: str, with_tokenizer: bool = True) -> None:
        """The role's weights as an HF model directory; ``with_tokenizer=False`` for readers that
        load weights only (a server's reload), which saves shipping the tokenizer to the worker."""
        self.dispatch.save_hf_model(role, export_dir, self.tokenizer if with_tokenizer else None)

    def save_checkpoint(self, role: str, ckpt_dir: str) -> None:
        self.dispatch.save_checkpoint(role, ckpt_dir, tokenizer=self.tokenizer)

    def load_checkpoint(self, role: str, ckpt_dir: str) -> None:
        """Weights with optimizer and LR scheduler states."""
        self.dispatch.load_checkpoint(role, ckpt_dir)

    def shutdown(self) -> None:
        """Kill every actor we started; the Ray runtime itself belongs to the launcher."""
        for group in self._groups.values():
            for actor in getattr(group, "_actor_handlers", []):
                with suppress(Exception):  # already dead: nothing left to release
                    ray.kill(actor, no_restart=True)
        self._groups.clear()
