"""Tiny causal LMs and tokenizers built in-process, for tests and the CPU quickstart.

Nothing touches a model hub: a byte-level BPE trained on a small generated corpus and a randomly
initialised model, cached by a hash of their config so a test suite builds each variant once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

# ChatML, plus the Hermes tool convention Qwen models use: tools listed in the system turn, an
# assistant's calls as <tool_call>{"name", "arguments"}</tool_call>, results in a "tool" turn. A chat
# without tools renders as plain ChatML; an assistant turn holding only tool calls has no content.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\n</tools>\nCall a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    "<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set fn = call['function'] or call %}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of a qwen3-type model small enough to train by RL on two CPU cores.

    The defaults (about 140K parameters) learn the digit-echo task in ~150 GRPO steps. qwen3,
    because its tokenizer class round-trips a trained byte-level BPE unchanged (test_tiny_model.py).
    Embeddings are untied by default: at this size a tied model learns the SFT example's addition
    several times slower (held-out loss 1.6 instead of 0.57 after its 200 steps); the tied-embedding
    tests train the tied variant.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    seed: int = 0

    def key(self) -> str:
        built_from = {"corpus": _corpus_version(), "template": CHAT_TEMPLATE}
        payload = json.dumps(asdict(self) | built_from, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    root = os.environ.get("RLLM_SKYRL_CACHE") or Path.home() / ".cache" / "rllm_skyrl"
    return Path(root) / "tiny_models"


def _corpus() -> list[str]:
    lines = []
    for a in range(10):
        lines += [f"what is {a}?", f"{a}"]
        for b in range(10):
            lines += [f"what is {a} plus {b}? {(a + b) % 10}", f"{a} + {b} = {a + b}"]
    words = (
        "the answer is a number . question solve think step final judge solver correct wrong "
        "yes no choose best option user assistant system you are helpful"
    )
    lines += [words] * 5
    return lines + [f"<|im_start|>{role}\nhello<|im_end|>\n" for role in ("system", "user", "assistant")]


def _corpus_version() -> str:
    return hashlib.sha256("\n".join(_corpus()).encode()).hexdigest()[:8]


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE with ChatML special tokens and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(config: TinyModelConfig | None = None, cache_dir: str | Path | None = None) -> Path:
    """Return a directory holding a saved tiny model + tokenizer, building it once per config."""
    config = config or TinyModelConfig()
    out = Path(cache_dir or default_cache_dir()) / f"qwen3-tiny-{config.key()}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer(config.vocab_size)
    shape = {k: v for k, v in asdict(config).items() if k not in ("vocab_size", "seed")}
    hf_config = Qwen3Config(
        **shape,
        vocab_size=len(tokenizer),
        head_dim=config.hidden_size // config.num_attention_heads,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    torch.manual_seed(config.seed)
    model = Qwen3ForCausalLM(hf_config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    # Build in a temp dir and rename, so concurrent builders never see a half-written model.
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out
