"""The gateway's HTTP/1.1 client for proxied calls to replicas: keep-alive pools, httptools' parser.

A request's call to its replica is the gateway's hot path: measured with py-spy at 200 streams, aiohttp's
client took a fifth of the gateway's CPU per request (request and timeout objects, header multidicts,
stream readers), more than any stage of Sarv's own. This client does only what that call needs: ``POST``
with a body already in memory to a plain-HTTP replica, the answer's status and headers, then its body whole
(:meth:`Response.read`), as it arrives (:meth:`Response.readany`, no buffering beyond what the socket
hands over) or handed to a callback as it arrives (:meth:`Response.pipe`, a streamed answer's relay).
Parsing is httptools' (llhttp, the parser uvicorn serves the gateway's own side with).
Discovery's polls, a few a second, keep aiohttp.

Behaviour a proxy depends on:

- a connection is reused only after a complete answer the replica allowed to be kept alive; leaving a
  request early (the client went away, a timeout) closes its connection, which is how vLLM learns to abort;
- a pooled connection the replica closed meanwhile (its keep-alive ran out) fails before any byte of the
  answer: the request is sent once more on a new connection, without counting against the replica;
- failures to connect and connections lost are :class:`UpstreamConnectionError`; the total timeout is
  :class:`TimeoutError` wherever the call is waiting (connecting, the head, the body);
- a slow reader of a streamed answer stops reading from the replica (TCP back-pressure) beyond 256 KiB
  buffered.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

import httptools

if TYPE_CHECKING:
    from aiohappyeyeballs import AddrInfoType

__all__ = ["H1Pool", "Response", "UpstreamConnectionError"]

_HIGH_WATER = 256 * 1024
"""Bytes of an answer buffered before the replica's socket stops being read."""
_MAX_IDLE_PER_ENDPOINT = 1024
_DNS_TTL_S = 10.0


class UpstreamConnectionError(ConnectionError):
    """The replica could not be reached, or the connection was lost or spoke malformed HTTP."""


class Response:
    """A replica's answer: ``status`` and ``headers`` (lower-case names) once its head is in, then the body;
    the body is read with :meth:`read` or :meth:`readany`."""

    __slots__ = (
        "_chunks", "_conn", "_done", "_error", "_head", "_paused", "_sink", "_size", "_waiter",
        "complete", "headers", "received", "status", "until_eof",
    )  # fmt: skip

    def __init__(self, conn: _Connection, head: asyncio.Future[None]) -> None:
        self._conn = conn
        self._head = head
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._paused = False
        self._sink: Callable[[bytes], None] | None = None
        self._done: asyncio.Future[None] | None = None
        self.complete = False
        self.received = False
        """Any byte of the answer arrived (a lost connection before that may be a stale pooled one)."""
        self.until_eof = False
        """The body has neither a length nor chunked framing: it ends when the connection does."""

    async def readany(self) -> bytes:
        """What has arrived of the body since the last call (waiting for some); ``b""`` at its end."""
        while True:
            if self._chunks:
                data = self._take()
                self.resume()
                return data
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    async def pipe(self, sink: Callable[[bytes], None]) -> None:
        """Hand the rest of the body to ``sink`` as it arrives, from the connection's own callback: no task
        switch, future or buffer per piece (one call per read from the socket). Returns at the body's end;
        raises what :meth:`readany` would. ``sink`` must not raise; :meth:`pause` and :meth:`resume` let
        it hold the replica back while its own reader is slow."""
        if self._chunks:
            sink(self._take())
        self.resume()
        if self._error is not None:
            raise self._error
        if self.complete:
            return
        self._sink = sink
        done = self._done = asyncio.get_running_loop().create_future()
        try:
            await done
        finally:
            self._sink = None
            self._done = None

    def pause(self) -> None:
        """Stop reading the replica's socket (TCP back-pressure) until :meth:`resume`."""
        if not self._paused:
            self._paused = True
            self._conn.pause()

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._conn.resume()

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # --- fed by the connection

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        if self._sink is not None:
            return  # handed over at the end of the socket read (_flush_sink)
        self._size += len(data)
        if self._size > _HIGH_WATER:
            self.pause()
        self._wake()

    def _take(self) -> bytes:
        """Everything buffered, as one piece; the buffer is empty after."""
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        return data

    def _flush_sink(self) -> None:
        sink = self._sink
        if sink is not None and self._chunks:
            sink(self._take())

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self.complete or self._error is not None:
            return
        self._error = exc
        if not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved: a caller that already left must not log it
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        done = self._done
        if done is not None and not done.done() and (self.complete or self._error is not None):
            self._flush_sink()  # what arrived with the end goes out before it
            if self._error is not None:
                done.set_exception(self._error)
            else:
                done.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica; at most one request on it at a time."""

    __slots__ = ("_parser", "closed", "endpoint", "idle_since", "pool", "resp", "reusable", "transport")

    def __init__(self, pool: H1Pool, endpoint: str) -> None:
        self.pool = pool
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.reusable = False
        self.idle_since = 0.0

    # --- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports don't subclass it

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or resp.complete:  # bytes nobody asked for: the connection can't be trusted
            self.close()
            return
        resp.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp._fail(UpstreamConnectionError(f"the replica answered malformed HTTP ({exc})"))
            self.close()
            return
        resp._flush_sink()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        resp = self.resp
        if resp is not None and not resp.complete:
            if resp.until_eof and resp.status:
                resp._finish()
            else:
                why = f": {exc}" if exc is not None else ""
                resp._fail(UpstreamConnectionError(f"the replica closed the connection{why}"))

    # --- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        status = self._parser.get_status_code()
        if status < 200:  # 1xx (we never send Expect): the real answer follows
            resp.headers.clear()
            return
        resp.status = status
        h = resp.headers
        framed = "content-length" in h or "chunked" in h.get("transfer-encoding", "")
        resp.until_eof = not framed and status not in (204, 304)
        if not resp._head.done():
            resp._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.resp is not None
        self.resp._feed(body)

    def on_message_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        if not resp.status:  # the end of a 1xx
            return
        self.reusable = self._parser.should_keep_alive() and not resp.until_eof
        resp._finish()

    # --- for the response and the pool

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.transport.abort()  # no lingering half-close: the replica sees the reset at once
        self.closed = True

    def start(self, head: bytes, body: bytes) -> Response:
        assert self.transport is not None
        # One parser for the connection's life: llhttp starts over after each complete keep-alive answer.
        self.reusable = False
        resp = self.resp = Response(self, asyncio.get_running_loop().create_future())
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)
        return resp


class _Call:
    """``async with pool.post(...) as resp``: the answer's head on entry; on exit the connection goes back
    to the pool after a complete answer, else it is closed."""

    __slots__ = (
        "_body", "_conn", "_connect_s", "_endpoint", "_expired", "_head", "_pool", "_resp", "_timer",
        "_total_s",
    )  # fmt: skip

    def __init__(  # noqa: PLR0917 (built by H1Pool.post only)
        self, pool: H1Pool, endpoint: str, head: bytes, body: bytes, total_s: float, connect_s: float
    ) -> None:
        self._pool = pool
        self._endpoint = endpoint
        self._head = head
        self._body = body
        self._total_s = total_s
        self._connect_s = connect_s
        self._conn: _Connection | None = None
        self._resp: Response | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    async def __aenter__(self) -> Response:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._total_s, self._expire)
        try:
            return await self._send()
        except BaseException:
            self._end(ok=False)
            raise

    async def _send(self) -> Response:
        pool = self._pool
        for pooled in (True, False):
            conn = pool.checkout(self._endpoint) if pooled else None
            reused = conn is not None
            if conn is None:
                conn = await pool.connect(self._endpoint, min(self._connect_s, self._total_s))
                if self._expired:  # the total ran out while connecting
                    conn.close()
                    raise TimeoutError(f"no complete answer within {self._total_s:g} s")
            self._conn = conn
            resp = self._resp = conn.start(self._head, self._body)
            try:
                await resp._head
                return resp
            except UpstreamConnectionError:
                conn.close()
                # A pooled connection the replica had closed (nothing of an answer came): try a new one.
                if not reused or resp.received:
                    raise
        raise AssertionError("unreachable")

    def _expire(self) -> None:
        self._timer = None
        self._expired = True
        if self._resp is not None:
            self._resp._fail(TimeoutError(f"no complete answer within {self._total_s:g} s"))
        if self._conn is not None:
            self._conn.close()

    def _end(self, ok: bool) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn, resp = self._conn, self._resp
        if conn is None:
            return
        self._conn = None
        if ok and resp is not None and resp.complete and resp._error is None and conn.reusable:
            conn.resp = None
            self._pool.checkin(conn)
        else:
            conn.close()

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._end(ok=et is None)


class H1Pool:
    """Keep-alive connections per replica endpoint (``http://host:port``), unbounded in number (the gateway's
    per-model gates bound concurrency). ``socket_factory`` makes each socket (options such as
    ``TCP_USER_TIMEOUT``); ``keepalive_s`` drops connections idle for longer."""

    def __init__(
        self,
        *,
        socket_factory: Callable[[AddrInfoType], socket.socket] | None = None,
        keepalive_s: float = 30.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._factory = socket_factory
        self._keepalive = keepalive_s
        self._mono = monotonic
        self._idle: dict[str, list[_Connection]] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}
        self._dns: dict[tuple[str, int], tuple[float, list[AddrInfoType]]] = {}
        self._closed = False

    def post(
        self,
        endpoint: str,
        path: str,
        headers: Mapping[str, str],
        body: bytes,
        *,
        total_s: float,
        connect_s: float,
    ) -> _Call:
        """A ``POST`` of ``body`` to ``endpoint + path``; ``total_s`` bounds the whole call, ``connect_s``
        a new connection's set-up."""
        host_line = self._target(endpoint)[2]
        lines = [b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\n", host_line,
                 b"content-length: ", str(len(body)).encode(), b"\r\n"]  # fmt: skip
        for name, value in headers.items():
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise ValueError(f"header {name!r} carries a line break")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"\r\n")
        return _Call(self, endpoint, b"".join(lines), body, total_s, connect_s)

    def _target(self, endpoint: str) -> tuple[str, int, bytes]:
        target = self._targets.get(endpoint)
        if target is None:
            url = urlsplit(endpoint)
            try:
                port = url.port or 80
            except ValueError:
                port = 0
            if url.scheme != "http" or not url.hostname or not port:
                raise UpstreamConnectionError(f"replica endpoint {endpoint!r} is not http://host:port")
            if len(self._targets) >= 4096:  # replicas come and go: start over rather than grow
                self._targets.clear()
            host_line = f"host: {url.netloc}\r\n".encode("latin-1")
            target = self._targets[endpoint] = (url.hostname, port, host_line)
        return target

    def checkout(self, endpoint: str) -> _Connection | None:
        idle = self._idle.get(endpoint)
        now = self._mono()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._keepalive:
                return conn
            conn.close()
        return None

    def checkin(self, conn: _Connection) -> None:
        if self._closed or conn.closed:
            conn.close()
            return
        idle = self._idle.setdefault(conn.endpoint, [])
        if len(idle) >= _MAX_IDLE_PER_ENDPOINT:
            conn.close()
            return
        conn.idle_since = self._mono()
        idle.append(conn)

    async def connect(self, endpoint: str, timeout_s: float) -> _Connection:
        if self._closed:
            raise UpstreamConnectionError("the gateway's upstream pool is closed")
        host, port, _ = self._target(endpoint)
        loop = asyncio.get_running_loop()
        conn = _Connection(self, endpoint)
        try:
            async with asyncio.timeout(timeout_s):
                sock = await self._socket(loop, host, port)
                await loop.create_connection(lambda: conn, sock=sock)
        except TimeoutError:
            raise UpstreamConnectionError(f"connecting to {endpoint} timed out ({timeout_s:g} s)") from None
        except OSError as exc:
            raise UpstreamConnectionError(f"cannot connect to {endpoint}: {exc}") from None
        return conn

    async def _socket(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
        last: OSError | None = None
        for info in await self._resolve(loop, host, port):
            family, type_, proto = info[0], info[1], info[2]
            sock = self._factory(info) if self._factory is not None else socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, info[4])
                return sock
            except OSError as exc:
                sock.close()
                last = exc
            except BaseException:
                sock.close()
                raise
        raise last or OSError(f"{host} resolves to no address")

    async def _resolve(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[AddrInfoType]:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
        now = self._mono()
        hit = self._dns.get((host, port))
        if hit is not None and now - hit[0] < _DNS_TTL_S:
            return hit[1]
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        if len(self._dns) >= 1024:
            self._dns.clear()
        self._dns[(host, port)] = (now, infos)  # type: ignore[assignment]  # same tuples, looser stub
        return infos  # type: ignore[return-value]

    def idle_connections(self, endpoint: str) -> int:
        return sum(1 for c in self._idle.get(endpoint, ()) if not c.closed)

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
