"""``python -m rllm_skyrl.compat.rllm_gateway_process PARENT_PID [rllm-model-gateway options]``.

rLLM's model gateway CLI (``rllm_model_gateway``) in a process that exits once ``PARENT_PID`` is no
longer its parent: a driver killed with SIGKILL must not leave a gateway behind holding a port. A
thread polls ``os.getppid()`` (as the inference servers do): ``PR_SET_PDEATHSIG`` would fire when
the forking *thread* exits, and is Linux-only.
"""

from __future__ import annotations

import os
import sys
import threading

PARENT_POLL_SECONDS = 1.0


def watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(PARENT_POLL_SECONDS)
        print(f"rLLM's model gateway: parent process {parent_pid} is gone; exiting", flush=True)
        os._exit(1)  # the traces it holds are only for the run that is gone

    threading.Thread(target=watch, name="rllm-skyrl-parent-watch", daemon=True).start()


def main(argv: list[str]) -> None:
    if not argv or not argv[0].isdigit():
        sys.exit("usage: python -m rllm_skyrl.compat.rllm_gateway_process PARENT_PID [gateway options]")
    watch_parent(int(argv[0]))
    from rllm_model_gateway.server import main as gateway_main

    sys.argv = ["rllm-model-gateway", *argv[1:]]
    gateway_main()


if __name__ == "__main__":
    main(sys.argv[1:])
