"""``python -m rllm_skyrl.inference --model DIR [--port P]``: serve a model until interrupted."""

from __future__ import annotations

import argparse
import signal
import threading

import torch

from rllm_skyrl.inference.server import InferenceServer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rllm_skyrl.inference", description=__doc__)
    parser.add_argument("--model", required=True, help="HF model directory (config, weights, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    parser.add_argument("--served-model-name", default=None, help="name clients pass as 'model'")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context limit (default: from config)"
    )
    parser.add_argument("--max-batch-size", type=int, default=256, help="most sequences decoded together")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler for unseeded requests")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: small models are dominated by per-op overhead, and "
        "more threads than free cores slows every step down sharply when a trainer shares the machine)",
    )
    parser.add_argument("--log-level", default="warning")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    server = InferenceServer(
        args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        max_batch_size=args.max_batch_size,
        dtype=args.dtype,
        seed=args.seed,
        log_level=args.log_level,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    print(f"rllm_skyrl inference server for {args.model} listening on {server.url}", flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
