"""``SkyRLSFTBackend``: rLLM's ``SFTBackend`` on SkyRL's own ``SFTTrainer`` and FSDP workers.

rLLM's dispatcher calls ``validate_spec`` -> ``build_config`` -> ``prepare_data`` -> ``fit``. The
rows are checked and tokenized by rLLM's rule before anything starts (``data``); ``fit`` starts the
run's Ray the way every run of this package does (on CPU its own local head, with the patch sets
that let SkyRL's workers train there), then runs SkyRL's trainer unchanged: ``setup``, ``train``
(checkpoints ``global_step_N`` with resume from the latest, validation loss, HF exports),
``shutdown``. The final weights are an HF model directory (``model_dir``) that an RL run takes as
``model.path``; a LoRA run's adapter is merged into its base there.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from omegaconf import DictConfig
from rllm.trainer.sft.backend import SFTBackend, SFTConfigError

from rllm_skyrl.hardware import Platform, cpu_threads
from rllm_skyrl.sft import config as sft_config
from rllm_skyrl.sft.data import check_rows, rows_of, write_pretokenized

logger = logging.getLogger(__name__)

INPUTS_DIR = "_skyrl_inputs"
MERGED_DIR = "merged"


class SkyRLSFTBackend(SFTBackend):
    """Supervised fine-tuning with SkyRL's ``SFTTrainer`` (FSDP; CUDA, or CPU through gloo)."""

    name = "skyrl"
    requires_distributed = False  # SkyRL places its workers through Ray itself

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.platform = Platform.detect()

    def validate_spec(self) -> None:
        sft_config.check_spec(self.spec)
        check_rows(self.spec.train_dataset, "train")
        if self.spec.val_dataset is not None:
            check_rows(self.spec.val_dataset, "val")

    def build_config(self) -> DictConfig:
        self._config = sft_config.native_config(self.spec, self._output_dir(), self.platform)
        return self._config

    def _output_dir(self) -> str:
        if self.spec.output_dir:
            return str(Path(self.spec.output_dir).resolve())
        from rllm import paths

        return paths.rllm_path("sft_runs", self.spec.project, self.spec.experiment or "default")

    @property
    def checkpoint_dir(self) -> str:
        return self.config.ckpt_path

    def prepare_data(self) -> None:
        """Tokenize the splits into ``<checkpoint_dir>/_skyrl_inputs/`` and fix the step count.

        The step count is set explicitly (rows / batch size, rounded up, times epochs: SkyRL pads a
        short last batch) so the workers' LR schedule spans the run, and the final HF export is
        the step that ends it.
        """
        from rllm_skyrl.runtime import load_tokenizer

        cfg = self.config
        tokenizer = load_tokenizer(cfg.model.path)
        inputs = Path(cfg.ckpt_path) / INPUTS_DIR
        method, max_length = cfg.rllm.tokenize_method, cfg.max_length
        train = write_pretokenized(
            rows_of(self.spec.train_dataset), tokenizer, method, max_length, inputs / "train.parquet", "train"
        )
        cfg.pretokenized_dataset_paths = [str(train.path)]
        if self.spec.val_dataset is not None:
            val = write_pretokenized(
                rows_of(self.spec.val_dataset), tokenizer, method, max_length, inputs / "val.parquet", "val"
            )
            cfg.eval_pretokenized_dataset_paths = [str(val.path)]
            cfg.eval_dataset_names = ["val"]
        else:
            cfg.eval_interval = 0
        cfg.num_steps = math.ceil(train.rows / cfg.batch_size) * cfg.num_epochs
        cfg.num_epochs = None
        cfg.hf_save_interval = cfg.ckpt_interval or cfg.num_steps
        logger.info(
            "SFT data: %d train rows (%d dropped at max_length), %d loss tokens; %d steps",
            train.rows,
            train.dropped,
            train.loss_tokens,
            cfg.num_steps,
        )

    def fit(self) -> None:
        """SkyRL's trainer on this process's Ray (started, and stopped again, if not running)."""
        from skyrl.train.sft_trainer import SFTTrainer

        from rllm_skyrl.ray_cluster import start_ray, stop_ray
        from rllm_skyrl.sft.metrics import RLLMMetrics, learning_rate_schedule
        from rllm_skyrl.sft.placement import WorkerPlacementGroups

        if not self.config.get("pretokenized_dataset_paths"):
            self.prepare_data()
        typed = sft_config.sft_config(self.config)
        skyrl_cfg = sft_config.training_config(typed, self.platform)
        threads = None if self.platform.cuda else cpu_threads(typed.placement.num_gpus_per_node)
        owns_ray = start_ray(
            skyrl_cfg, Path(typed.ckpt_path) / "logs", platform=self.platform, cpu_threads=threads
        )
        metrics = RLLMMetrics(
            typed.ckpt_path, learning_rate_schedule(typed.optimizer_config, typed.num_steps)
        )
        trainer = SFTTrainer(typed, skyrl_cfg, callbacks=[metrics])
        workers = WorkerPlacementGroups(typed.placement.num_nodes, typed.placement.num_gpus_per_node)
        try:
            with workers.recording():
                trainer.setup()
            trainer.train()
        finally:
            try:
                trainer.shutdown()
            finally:
                workers.remove()  # SkyRL's trainer leaves its workers to the Ray it ran on
                if owns_ray:
                    stop_ray()
        if typed.model.lora.rank:
            self._merge_adapter()

    @property
    def export_dir(self) -> Path:
        """SkyRL's HF export of the last step (the adapter alone for a LoRA run)."""
        return Path(self.config.export_path) / f"global_step_{self.config.num_steps}" / "policy"

    @property
    def model_dir(self) -> Path:
        """The trained model as a plain HF directory: what an RL run takes as ``model.path``."""
        return self.export_dir.parent / MERGED_DIR if self.config.model.lora.rank else self.export_dir

    def _merge_adapter(self) -> None:
        from rllm_skyrl.update.lora_merge import merge_adapter

        if not (self.export_dir / "adapter_config.json").exists():
            raise SFTConfigError(f"{self.export_dir}: SkyRL wrote no LoRA adapter there; see its log above")
        merge_adapter(self.export_dir, self.model_dir, base_model=self.config.model.path)
