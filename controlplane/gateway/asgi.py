"""The ASGI types the gateway's stages share, and its two ways of answering a request itself."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from controlplane.gateway.errors import ApiError, error_body

__all__ = ["JSON", "Message", "Receive", "Scope", "Send", "respond", "respond_error"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = [(b"content-type", b"application/json")]


async def respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    hdrs = list(headers or JSON)
    hdrs.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


async def respond_error(send: Send, exc: ApiError, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [*JSON, *extra] if extra else list(JSON)
    if exc.headers:
        headers += exc.headers
    if exc.retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(exc.retry_after))).encode()))
    await respond(
        send, exc.status, error_body(exc.status, exc.message, param=exc.param, code=exc.code), headers
    )
