"""ASGI layers around the routes: the run's token, the body size limit, and last-resort errors.

Outside FastAPI's routing, so a request without the token or with an oversized body is refused
before any of it is parsed. The token is accepted as ``Authorization: Bearer <token>`` or as the
HTTP Basic password: Basic is what aiohttp sends for ``http://user:<token>@host:port``, which is
how SkyRL's ``RemoteInferenceClient`` (it has no auth option) reaches an authenticated server.

Starlette answers an unhandled exception with a 500 and re-raises it, and uvicorn then closes the
keep-alive connection, so the client's next request on it fails with a ``ReadError``;
``LastResortErrors`` answers instead and keeps the connection open.
"""

from __future__ import annotations

import base64
import hmac
import logging
from typing import Any

import orjson

from rllm_skyrl.inference.errors import ApiError

logger = logging.getLogger(__name__)

TOKEN_ENV = "RLLM_SKYRL_SERVER_TOKEN"
OPEN_PATHS = frozenset({"/health"})


async def send_error(send: Any, error: ApiError) -> None:
    """For layers that run outside FastAPI's exception handlers."""
    body = orjson.dumps(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def presented_token(authorization: bytes) -> bytes | None:
    """The secret in an ``Authorization`` header: a Bearer token, or a Basic password."""
    scheme, _, value = authorization.strip().partition(b" ")
    scheme, value = scheme.lower(), value.strip()
    if scheme == b"bearer":
        return value
    if scheme == b"basic":
        try:
            return base64.b64decode(value, validate=True).partition(b":")[2]
        except ValueError:  # binascii.Error included
            return None
    return None


class TokenAuth:
    def __init__(self, app: Any, token: str):
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await send_error(
            send,
            ApiError(
                401,
                "missing or wrong credentials: send 'Authorization: Bearer <token>' (or HTTP Basic with the "
                "token as password) with the token of the run that started this server",
                {"WWW-Authenticate": 'Bearer realm="rllm_skyrl"'},
            ),
        )

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                presented = presented_token(value)
                return presented is not None and hmac.compare_digest(presented, self.token)
        return False


class BodyLimit:
    """Refuse (413) a body over ``max_bytes``: by its Content-Length, or for a chunked body once the
    bytes read pass the limit. The connection stays open (uvicorn drains the rest): closing it while
    the client still sends would show the client a connection error instead of the 413."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"request body exceeds {self.max_bytes} bytes; send less, or restart the server with a "
            "larger --max-body-mb",
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, self._too_large())
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)


class LastResortErrors:
    """A JSON 500 for an exception no handler took, keeping the connection usable."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            message = f"internal error: {type(exc).__name__}: {exc}; see the server log"
            await send_error(send, ApiError(500, message))
