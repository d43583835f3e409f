"""Throughput of the CPU inference server vs raw HF ``model.generate``, measured in the same run.

Both sides sample the same number of tokens for the same prompts (``min_tokens = max_tokens``,
temperature 1, no top-k/top-p) with the same torch thread count. The server is timed end to end:
SkyRL's ``RemoteInferenceClient`` in this process, the server in a subprocess (as in training),
so HTTP, JSON and the returned logprobs are all inside the measurement; ``generate`` returns no
logprobs. Runs alternate between the two sides so background load hits both alike; the median
of ``--repeats`` runs is reported.

    python bench/bench_inference.py [--batch 8 32] [--new-tokens 64] [--model DIR | --size medium]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import torch

SIZES = {
    "tiny": {},  # TinyModelConfig defaults, about 107K parameters
    "medium": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "intermediate_size": 768,
        "num_attention_heads": 8,
    },
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF model dir (default: a generated tiny model)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="generated model size")
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    return parser.parse_args()


def model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from rllm_skyrl.tiny_model import TinyModelConfig, build_tiny_model

    return str(build_tiny_model(TinyModelConfig(**SIZES[args.size])))


def make_prompts(tokenizer, batch: int) -> list[list[int]]:
    questions = [f"what is {i % 10} plus {(3 * i) % 10}?" + " think" * (i % 4) for i in range(batch)]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q in questions
    ]


def hf_generate_seconds(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            pad_token_id=pad,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return elapsed


def start_server(path: str, threads: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rllm_skyrl.inference", "--model", path, "--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"the inference server did not start: {line!r}")
    return proc, line.strip().rsplit(" ", 1)[-1]


async def server_generate_seconds(client, prompts: list[list[int]], new_tokens: int) -> float:
    params = {
        "max_tokens": new_tokens,
        "min_tokens": new_tokens,
        "temperature": 1.0,
        "top_k": -1,
        "logprobs": 0,
    }
    start = time.perf_counter()
    out = await client.generate({"prompt_token_ids": prompts, "sampling_params": params})
    elapsed = time.perf_counter() - start
    assert all(len(ids) == new_tokens for ids in out["response_ids"])
    return elapsed


async def bench(args: argparse.Namespace, path: str) -> None:
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = sum(p.numel() for p in model.parameters())
    proc, url = start_server(path, args.threads)
    try:
        client = RemoteInferenceClient(
            proxy_url=url, server_urls=[url], data_parallel_size=1, tokenizer=tokenizer
        )
        print(f"model {path} ({params / 1e6:.2f}M params)")
        print(f"{args.new_tokens} new tokens per sequence, torch threads {args.threads}")
        print(f"{'batch':>6} {'HF generate tok/s':>18} {'server tok/s':>13} {'ratio':>6}")
        for batch in args.batch:
            prompts = make_prompts(tokenizer, batch)
            hf_generate_seconds(model, tokenizer, prompts, 4)  # warm-up
            await server_generate_seconds(client, prompts, 4)
            hf, served = [], []
            for _ in range(args.repeats):
                hf.append(hf_generate_seconds(model, tokenizer, prompts, args.new_tokens))
                served.append(await server_generate_seconds(client, prompts, args.new_tokens))
            tokens = batch * args.new_tokens
            hf_rate, served_rate = tokens / statistics.median(hf), tokens / statistics.median(served)
            print(f"{batch:>6} {hf_rate:>18.0f} {served_rate:>13.0f} {served_rate / hf_rate:>6.2f}")
        await client.teardown()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    args = parse_args()
    asyncio.run(bench(args, model_dir(args)))


if __name__ == "__main__":
    main()
