"""The teacher for the distillation example: the tiny model taught the digit task by supervised
fine-tuning, saved as an HF model directory the CPU inference server serves.

``python -m examples.distill.teacher OUT_DIR [STEPS]``. The teacher is this example's fixture, not
what it demonstrates, so it is trained the quickest way: a plain cross-entropy loop over the ten
question/answer pairs, a few seconds on one core. The same loop stopped after 20 steps is the
student's start (``train.sh``): it samples the right digit ~13% of the time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from examples.simple_math.task import reward_fn
from rllm_skyrl.tiny_model import TinyModelConfig, build_tiny_model


def digit_pairs(tokenizer) -> list[tuple[list[int], list[int]]]:
    """Each question as the rollout engine renders it, and its answer ending the turn."""
    pairs = []
    for digit in range(10):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"what is {digit}?"}], tokenize=False, add_generation_prompt=True
        )
        answer = tokenizer.encode(str(digit), add_special_tokens=False) + [tokenizer.eos_token_id]
        pairs.append((tokenizer.encode(text, add_special_tokens=False), answer))
    return pairs


def train_teacher(
    out_dir: str | Path,
    steps: int = 100,
    lr: float = 3e-3,
    seed: int = 0,
    shape: TinyModelConfig | None = None,
) -> Path:
    """Fine-tune the tiny model (of ``shape``; another vocabulary size gives a teacher with its own
    tokenizer) on the ten pairs and save it, with its tokenizer, to ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(shape)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only loses time to threads contending
    pairs = digit_pairs(tokenizer)
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((len(pairs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)  # loss on the answer tokens only
    mask = torch.zeros_like(ids)
    for row, (prompt, answer) in enumerate(pairs):
        sequence = prompt + answer
        ids[row, : len(sequence)] = torch.tensor(sequence)
        labels[row, len(prompt) : len(sequence)] = torch.tensor(answer)
        mask[row, : len(sequence)] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)  # as the caller had it (a test session goes on)
    model.eval()
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(
        f"teacher: final loss {loss.item():.4f}, "
        f"greedy accuracy {greedy_accuracy(model, tokenizer):.2f}, saved to {out}"
    )
    return out


def greedy_accuracy(model, tokenizer) -> float:
    """The digit task's reward of the teacher's greedy answers, over the ten questions."""
    scores = []
    with torch.no_grad():
        for digit, (prompt, _) in enumerate(digit_pairs(tokenizer)):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False)
            text = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
            scores.append(reward_fn({"answer": str(digit)}, text))
    return sum(scores) / len(scores)


if __name__ == "__main__":
    train_teacher(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
