"""The ASGI types the gateway's stages share, and its two ways of answering a request itself."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

from controlplane.gateway.errors import ApiError, error_body

__all__ = [
    "CONNECTION",
    "JSON",
    "Connection",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "connection",
    "respond",
    "respond_error",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON = [(b"content-type", b"application/json")]

CONNECTION = "sarv.connection"
"""The scope extension under which the gateway's own HTTP protocol (server.py) offers :class:`Connection`."""


class Connection(Protocol):
    """What the gateway's HTTP protocol tells the app about a request's connection, without the task per
    request (a ``receive()`` left waiting for ``http.disconnect``) or the ``asyncio.timeout`` per body read
    that plain ASGI needs for the same. Under another ASGI server the app falls back to those."""

    lost: bool
    """The client's connection is gone."""
    on_lost: Callable[[], None] | None
    """Called once when the connection is lost; set (and cleared) by the request being served."""
    body_expired: bool
    """The current request's body did not arrive within the deadline :meth:`expect_body` set."""

    on_writable: Callable[[], None] | None
    """Called once when the client's connection, paused for writing, can take more."""

    def expect_body(self, timeout_s: float) -> None:
        """A deadline for the rest of the current request's body (nothing to do when it has all arrived):
        past it ``body_expired`` is set and a waiting ``receive()`` returns."""

    def chunked(self) -> bool:
        """The current response's head has gone out and its body is chunked: :meth:`write_chunk` may be
        used until the last ``http.response.body`` message, which still goes through ``send``."""

    def write_chunk(self, data: bytes) -> bool:
        """Write ``data`` as one chunk of the current response's body, as ``send`` would, without a
        message, a coroutine or a task switch; nothing once the connection is closing. True when the
        client's connection is now paused for writing (wait for ``on_writable``)."""


def connection(scope: Scope) -> Connection | None:
    extensions = scope.get("extensions")
    return None if extensions is None else extensions.get(CONNECTION)


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
