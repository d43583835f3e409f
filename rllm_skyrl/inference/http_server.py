"""``InferenceServer``: the CPU inference server as an object (uvicorn on a background thread)."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
import threading
import time
from pathlib import Path

import uvicorn

from rllm_skyrl.errors import UserFacingError
from rllm_skyrl.inference.routes import build_app
from rllm_skyrl.inference.served_model import InferenceService

KEEP_ALIVE_S = 30


class PortInUseError(UserFacingError):
    """The port asked for is taken: the raw ``OSError`` names neither the port nor a way out."""


class InferenceServer:
    """Serve ``model_dir`` over HTTP in this process until ``stop()``; ``port=0`` binds a free port.

    The HTTP and generation loops run on daemon threads, so the caller's thread stays free (tests
    drive it with SkyRL's own client from the same process). ``token``: every route but /health
    requires it. ``weights_root``: the only tree weights and adapters load from (None: refused).
    ``max_body_bytes`` and ``max_waiting`` bound what one client can make the server hold.
    """

    def __init__(
        self,
        model_dir: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        weights_root: str | Path | None = None,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        max_batch_size: int = 256,
        max_waiting: int = 4096,
        max_body_bytes: int = 16 << 20,
        dtype: str = "float32",
        seed: int = 0,
        log_level: str = "warning",
    ):
        if token is None and not is_loopback(host):
            raise ValueError(
                f"refusing to serve on {host!r} without a token: anyone who can reach it could drive "
                "generation and load weights; set a token (RLLM_SKYRL_SERVER_TOKEN for the CLI) or bind "
                "127.0.0.1"
            )
        self.host = host
        self.port = port
        self.log_level = log_level
        self.service = InferenceService(
            model_dir,
            served_model_name=served_model_name,
            max_model_len=max_model_len,
            max_batch_size=max_batch_size,
            max_waiting=max_waiting,
            dtype=dtype,
            seed=seed,
            weights_root=weights_root,
        )
        self.app = build_app(self.service, token=token, max_body_bytes=max_body_bytes)
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._uvicorn is None:
            raise RuntimeError("the server is not running; call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def served_model_name(self) -> str:
        return self.service.served_model_name

    def start(self, timeout: float = 30.0) -> InferenceServer:
        if self._uvicorn is not None:
            return self
        sock = bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level=self.log_level,
            access_log=False,
            # Outlive every client's idle connections: SkyRL's keeps them 2 s, httpx's pools (rLLM's
            # model gateway) 5 s. At 5 s both ends dropped a connection idle through a weight sync at
            # the same moment, and the gateway's next call on it failed (ReadError, a 500 to the flow).
            timeout_keep_alive=KEEP_ALIVE_S,
            backlog=4096,
            timeout_graceful_shutdown=5,
        )
        self._uvicorn = uvicorn.Server(config)
        self.service.start()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._uvicorn.serve(sockets=[sock])),
            name="rllm-skyrl-http",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the inference server did not start on {self.host}:{self.port}; see the log above"
                )
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        # Scheduler first: it fails whatever is still queued, so no HTTP handler is left waiting.
        self.service.stop()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
        self._uvicorn, self._thread = None, None

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port); a taken port is ``PortInUseError``.

    IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on connections whose socket says
    TCP. Without it Nagle holds a response's body until the client acknowledges its headers, and the
    client's delayed ACK makes that wait (bench/README.md: 'A step').
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno != errno.EADDRINUSE:
            raise
        raise PortInUseError(
            f"port {port} on {host} is in use by another process: stop that process, or pick another "
            "--port (0 picks a free one)"
        ) from None
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
