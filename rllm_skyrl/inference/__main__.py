"""``python -m rllm_skyrl.inference --model DIR [--port P]``: serve a model until interrupted.

The token (every route but /health then requires it) comes from ``RLLM_SKYRL_SERVER_TOKEN``, never
from the command line, where ``ps`` would show it to every user; it is removed from this process's
environment once read. Without a token the server only binds a loopback address.

``--parent-pid PID``: exit when that process is gone (``start_cpu_servers`` passes its own pid). A
thread polls ``os.getppid()``: ``prctl(PR_SET_PDEATHSIG)`` fires when the *thread* that forked the
server exits, so servers started from a worker thread (a thread pool, ``asyncio.to_thread``) would
die with it, and it is Linux-only. Polling also notices a parent killed by SIGKILL.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading

from rllm_skyrl import compat

compat.apply(["transformers_import_cache"])  # before transformers is imported (by the server's modules)

import torch  # noqa: E402

from rllm_skyrl.inference.http_server import InferenceServer, PortInUseError, bind, is_loopback  # noqa: E402
from rllm_skyrl.inference.middleware import TOKEN_ENV  # noqa: E402

PARENT_POLL_SECONDS = 0.5
FORCED_EXIT_SECONDS = 5.0  # after the parent died: a stop that hangs longer ends the process


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rllm_skyrl.inference", description=__doc__)
    parser.add_argument("--model", required=True, help="HF model directory (config, weights, tokenizer)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help=f"bind address (default: loopback only; any other needs a token in ${TOKEN_ENV})",
    )
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    parser.add_argument(
        "--weights-root",
        help="the only directory tree /rllm_skyrl/v1/load_weights and the LoRA routes read from "
        "(default: none, weight loading is refused)",
    )
    parser.add_argument("--served-model-name", help="name clients pass as 'model'")
    parser.add_argument("--max-model-len", type=int, help="context limit (default: from config)")
    parser.add_argument("--max-batch-size", type=int, default=256, help="most sequences decoded together")
    parser.add_argument(
        "--max-waiting", type=int, default=4096, help="most requests queued; beyond, 503 + Retry-After"
    )
    parser.add_argument("--max-body-mb", type=float, default=16.0, help="largest request body; beyond, 413")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler for unseeded requests")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: small models are dominated by per-op overhead, and "
        "more threads than free cores slows every step down sharply when a trainer shares the machine)",
    )
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    args.token = os.environ.pop(TOKEN_ENV, None) or None
    if args.token is None and not is_loopback(args.host):
        parser.error(
            f"--host {args.host} is reachable from other machines: set a token in ${TOKEN_ENV} (clients "
            "then send 'Authorization: Bearer <token>'), or bind 127.0.0.1"
        )
    return args


def watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """Set ``stop`` once ``parent_pid`` is no longer our parent (it died; we were re-parented)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            if stop.wait(PARENT_POLL_SECONDS):
                return
        print(f"parent process {parent_pid} is gone; stopping", flush=True)
        # A stop that hangs must not leave the server behind: end the process regardless.
        deadline = threading.Timer(FORCED_EXIT_SECONDS, os._exit, args=(1,))
        deadline.daemon = True
        deadline.start()
        stop.set()

    threading.Thread(target=watch, name="rllm-skyrl-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if args.parent_pid is not None:
        watch_parent(args.parent_pid, stop)  # before loading the model, which takes seconds
    if args.port:  # a taken port is one line before the model loads (start() binds it for good)
        try:
            bind(args.host, args.port).close()
        except PortInUseError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
    server = InferenceServer(
        args.model,
        host=args.host,
        port=args.port,
        token=args.token,
        weights_root=args.weights_root,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        max_batch_size=args.max_batch_size,
        max_waiting=args.max_waiting,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        dtype=args.dtype,
        seed=args.seed,
        log_level=args.log_level,
    )
    if stop.is_set():
        return
    server.start()
    gc.freeze()  # what is loaded lives as long as the server: full collections walk only new objects
    if args.token is None:
        print("warning: no token set; any local process can drive this server", file=sys.stderr, flush=True)
    print(f"rllm_skyrl inference server for {args.model} listening on {server.url}", flush=True)
    stop.wait()
    server.stop()
    gc.freeze()  # the exit's last collection would walk all of torch (seconds on a busy machine)


if __name__ == "__main__":
    main()
