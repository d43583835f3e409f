"""A trained LoRA adapter folded into its base model, for tools that only know plain transformers.

SkyRL exports a LoRA policy as a PEFT adapter directory, which vLLM and this package's server
serve as is. ``merge_adapter`` writes the base model with every adapted weight replaced by
``W + (alpha / r) * B @ A`` (PEFT's ``merge_and_unload``), which loads with no PEFT installed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def merge_adapter(adapter_dir: str | Path, merged_dir: str | Path, base_model: str | None = None) -> Path:
    """Write base model + adapter as one transformers model directory; returns ``merged_dir``.

    ``base_model`` defaults to the adapter's ``base_model_name_or_path``. The merge runs in float32
    and is saved in the base checkpoint's dtype; the directory appears complete or not at all.
    """
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    adapter_dir, merged_dir = Path(adapter_dir), Path(merged_dir)
    if not (adapter_dir / "adapter_config.json").exists():
        raise FileNotFoundError(
            f"{adapter_dir} holds no adapter_config.json: pass the directory a LoRA policy was exported to"
        )
    base = base_model or PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path
    saved_dtype = AutoConfig.from_pretrained(base).dtype or torch.float32
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    work = merged_dir.with_name(f".{merged_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    merged.to(saved_dtype).save_pretrained(work)
    tokenizer_source = adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else base
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(work)
    shutil.rmtree(merged_dir, ignore_errors=True)
    os.replace(work, merged_dir)
    return merged_dir
