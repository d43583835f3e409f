"""The one error type the server raises on purpose, rendered as OpenAI/vLLM-style error JSON."""

from __future__ import annotations

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 501: "NotImplementedError"}


class ApiError(Exception):
    """A request the server refuses; ``message`` should tell the caller what to change."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    def body(self) -> dict:
        """``{"error": {...}}``: the shape SkyRL's client reads ``error.message`` from."""
        kind = _TYPES.get(self.status, "InternalServerError" if self.status >= 500 else "BadRequestError")
        return {"error": {"message": self.message, "type": kind, "code": self.status}}
