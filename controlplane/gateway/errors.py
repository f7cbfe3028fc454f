"""Gateway refusals as one exception carrying an OpenAI-shaped JSON error body and its HTTP status."""

from __future__ import annotations

import json

__all__ = ["ApiError", "error_body"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    """OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


class ApiError(Exception):
    """A refusal the gateway answers itself; ``status`` < 500 always means the client's mistake."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        reason: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.reason = reason or code or "invalid"
        """Short label for the rejection metrics (bounded set)."""
        self.headers = headers
        """Extra response headers (``x-ratelimit-*`` on a 429)."""

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, code=self.code)
