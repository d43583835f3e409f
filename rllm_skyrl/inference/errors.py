"""The one error type the server raises on purpose, rendered as OpenAI/vLLM-style error JSON."""

from __future__ import annotations

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "PayloadTooLargeError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """A request the server refuses; ``message`` should tell the caller what to change, ``headers``
    go on the response (``Retry-After`` on a full queue, ``WWW-Authenticate`` on 401)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}

    def body(self) -> dict:
        """``{"error": {...}}``: the shape SkyRL's client reads ``error.message`` from."""
        kind = _TYPES.get(self.status, "InternalServerError" if self.status >= 500 else "BadRequestError")
        return {"error": {"message": self.message, "type": kind, "code": self.status}}
