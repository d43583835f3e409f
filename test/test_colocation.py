"""``colocate_all``: the trainer's actors join SkyRL's shared placement group with a fraction of a GPU.

On CPU the logical GPUs stand in for real ones, so this runs the colocated bring-up on SkyRL's
real FSDP workers; what it cannot show is vLLM sharing the GPU, SkyRL's offload and backload of
the models, and the CUDA IPC weight transfer (``scripts/gpu_check.sh`` does, on a GPU).
"""

from __future__ import annotations

import pytest
import ray
from helpers import FP32, PAIRS, sft_batch

from rllm_skyrl.hardware import Platform
from rllm_skyrl.rollout.servers import colocated_placement_group
from rllm_skyrl.run_config import make_skyrl_config
from rllm_skyrl.update.workers import COLOCATED_GPU_SHARE, SkyRLWorkers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def colocated_config(model_dir: str, tmp_path):
    """The config a one-GPU CUDA run gets (sdpa, colocated), with fp32 so CPU can run it."""
    return make_skyrl_config(
        {
            "trainer.policy.model.path": model_dir,
            "trainer.policy.fsdp_config.mixed_precision": FP32,
            "trainer.policy.optimizer_config.lr": 1e-3,
            "trainer.placement.colocate_all": True,
            "trainer.use_expandable_segments": False,
            "trainer.micro_train_batch_size_per_gpu": 8,
            "trainer.micro_forward_batch_size_per_gpu": 8,
            "trainer.algorithm.use_kl_loss": False,
            "trainer.ckpt_path": str(tmp_path / "ckpt"),
            "trainer.export_path": str(tmp_path / "export"),
            "trainer.log_path": str(tmp_path / "logs"),
        },
        platform=Platform(cuda=True, flash_attn=False),
    )


def test_colocated_workers_need_the_shared_placement_group(tiny_model_dir, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="placement group shared with the vLLM servers"):
        SkyRLWorkers(colocated_config(tiny_model_dir, tmp_path), tiny_tokenizer)


def test_colocated_workers_train_in_the_shared_placement_group(tiny_model_dir, tiny_tokenizer, tmp_path):
    cfg = colocated_config(tiny_model_dir, tmp_path)
    assert cfg.trainer.placement.colocate_all is True
    pg = colocated_placement_group(cfg)
    workers = None
    try:
        assert len(pg.pg.bundle_specs) == 1 and pg.pg.bundle_specs[0]["GPU"] == 1
        workers = SkyRLWorkers(cfg, tiny_tokenizer, placement_group=pg)
        assert workers.dispatch.colocate_all
        # The policy actor holds a fifth of the bundle's GPU: vLLM's actors fit beside it.
        group_gpus = f"GPU_group_{pg.pg.id.hex()}"
        assert ray.available_resources()[group_gpus] == pytest.approx(1 - COLOCATED_GPU_SHARE)
        batch, *_ = sft_batch(tiny_tokenizer, PAIRS)
        losses = []
        for _ in range(3):
            losses.append(workers.forward_backward("policy", batch, loss_fn="cross_entropy").metrics["loss"])
            assert workers.optim_step("policy") > 0
        assert losses[-1] < losses[0]
    finally:
        if workers is not None:
            workers.shutdown()
        ray.util.remove_placement_group(pg.pg)


def test_colocated_share_matches_skyrls_trainer():
    """SkyRL's own trainer gives colocated actors the same GPU share we do."""
    import inspect

    from skyrl.train.trainer import RayPPOTrainer

    assert f"num_gpus_per_actor={COLOCATED_GPU_SHARE} if pg else 1" in inspect.getsource(
        RayPPOTrainer.build_models
    )
