"""The gateway's HTTP/1.1 client (controlplane/gateway/h1.py) against a raw server on loopback that answers
each request as a test scripts it: keep-alive reuse, framing (length, chunked, until close), a pooled
connection the replica closed, truncation, timeouts, an early exit, back-pressure. Run on asyncio's loop
and on uvloop's (the gateway's)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from controlplane.gateway.h1 import H1Pool, UpstreamConnectionError
from controlplane.gateway.upstream import upstream_socket_factory

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
"""Answers one request on a connection (the connection's number given); False closes the connection."""


class Server:
    """Loopback server: counts connections and requests; ``handler`` answers each request."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.lower().split(b"\r\n")
                length = next((int(ln.split(b":")[1]) for ln in lines if ln.startswith(b"content-length")), 0)
                self.requests.append(head + await reader.readexactly(length))
                if not await self.handler(reader, writer, n):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body,
    )  # fmt: skip


def answering(data: bytes, keep: bool = True) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(data)
        await writer.drain()
        return keep

    return handle


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    def go(coro: Coroutine[Any, Any, None]) -> None:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as runner:
            runner.run(asyncio.wait_for(coro, 30))

    return go


async def post(pool: H1Pool, endpoint: str, total_s: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    async with pool.post(endpoint, "/v1/x", {"content-type": "application/json"}, b"{}", total_s=total_s,
                         connect_s=5.0) as resp:  # fmt: skip
        return resp.status, resp.headers, await resp.read()


def test_a_complete_answer_leaves_its_connection_for_the_next_request(run: Any) -> None:
    async def main() -> None:
        async with Server(answering(ok())) as srv:
            pool = H1Pool()
            for _ in range(3):
                status, headers, body = await post(pool, srv.endpoint)
                assert (status, headers["content-type"], body) == (200, "application/json", b'{"ok":true}')
            assert srv.connections == 1
            first = srv.requests[0]
            assert first.startswith(b"POST /v1/x HTTP/1.1\r\n")
            assert f"host: {srv.endpoint.removeprefix('http://')}\r\n".encode() in first
            assert b"content-length: 2\r\n" in first and first.endswith(b"\r\n\r\n{}")
            await pool.close()

    run(main())


def test_an_answer_that_says_close_is_not_reused(run: Any) -> None:
    async def main() -> None:
        async with Server(answering(ok(extra=b"connection: close\r\n"), keep=False)) as srv:
            pool = H1Pool()
            await post(pool, srv.endpoint)
            await post(pool, srv.endpoint)
            assert srv.connections == 2
            await pool.close()

    run(main())


def test_a_chunked_stream_is_handed_over_as_it_arrives(run: Any) -> None:
    async def main() -> None:
        go_on = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
            writer.write(b"transfer-encoding: chunked\r\n\r\n")
            writer.write(b"6\r\ndata: \r\n")
            await writer.drain()
            await go_on.wait()
            writer.write(b"2\r\n1\n\r\n0\r\n\r\n")
            await writer.drain()
            return True

        async with Server(handle) as srv:
            pool = H1Pool()
            async with pool.post(srv.endpoint, "/s", {}, b"", total_s=10, connect_s=5) as resp:
                assert resp.headers["content-type"] == "text/event-stream"
                assert await resp.readany() == b"data: "  # before the rest was even sent
                go_on.set()
                assert await resp.readany() == b"1\n"
                assert await resp.readany() == b""
            assert pool.idle_connections(srv.endpoint) == 1
            await pool.close()

    run(main())


def test_a_body_that_ends_with_the_connection_is_whole_and_the_connection_is_dropped(run: Any) -> None:
    async def main() -> None:
        unframed = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it"
        async with Server(answering(unframed, keep=False)) as srv:
            pool = H1Pool()
            assert (await post(pool, srv.endpoint))[2] == b"all of it"
            assert pool.idle_connections(srv.endpoint) == 0
            await pool.close()

    run(main())


def test_a_pooled_connection_the_replica_dropped_is_replaced_without_an_error(run: Any) -> None:
    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
            # Connection 1 answers once, then drops the next request unanswered (its keep-alive ran out).
            if n == 1 and len(srv.requests) > 1:
                return False
            writer.write(ok())
            await writer.drain()
            return True

        async with Server(handle) as srv:
            pool = H1Pool()
            await post(pool, srv.endpoint)
            assert (await post(pool, srv.endpoint))[0] == 200
            assert srv.connections == 2 and len(srv.requests) == 3
            await pool.close()

    run(main())


def test_a_new_connection_dropped_before_an_answer_is_an_error_not_a_retry(run: Any) -> None:
    async def main() -> None:
        async with Server(answering(b"", keep=False)) as srv:
            pool = H1Pool()
            with pytest.raises(UpstreamConnectionError, match="closed the connection"):
                await post(pool, srv.endpoint)
            assert len(srv.requests) == 1
            await pool.close()

    run(main())


def test_a_truncated_body_is_an_error(run: Any) -> None:
    async def main() -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789"
        async with Server(answering(head, keep=False)) as srv:
            pool = H1Pool()
            async with pool.post(srv.endpoint, "/x", {}, b"", total_s=10, connect_s=5) as resp:
                assert resp.status == 200
                with pytest.raises(UpstreamConnectionError):
                    await resp.read()
            assert pool.idle_connections(srv.endpoint) == 0
            await pool.close()

    run(main())


def test_malformed_http_is_an_error(run: Any) -> None:
    async def main() -> None:
        async with Server(answering(b"SPDY/9 what\r\n\r\n", keep=False)) as srv:
            pool = H1Pool()
            with pytest.raises(UpstreamConnectionError, match="malformed"):
                await post(pool, srv.endpoint)
            await pool.close()

    run(main())


def test_the_total_timeout_ends_the_call_and_its_connection(run: Any) -> None:
    async def main() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
            await reader.read(1)  # returns at the gateway's close
            return False

        async with Server(silent) as srv:
            pool = H1Pool()
            with pytest.raises(TimeoutError):
                await post(pool, srv.endpoint, total_s=0.3)
            await asyncio.wait_for(srv.closed.wait(), 5)
            await pool.close()

    run(main())


def test_leaving_before_the_end_closes_the_connection(run: Any) -> None:
    async def main() -> None:
        async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            await reader.read(1)  # until the gateway hangs up
            return False

        async with Server(endless) as srv:
            pool = H1Pool()
            async with pool.post(srv.endpoint, "/x", {}, b"", total_s=10, connect_s=5) as resp:
                assert await resp.readany() == b"hello"
            await asyncio.wait_for(srv.closed.wait(), 5)  # the replica learns at once: vLLM aborts
            assert pool.idle_connections(srv.endpoint) == 0
            await pool.close()

    run(main())


def test_a_slow_reader_stops_reading_from_the_replica(run: Any) -> None:
    async def main() -> None:
        body = b"x" * (4 * 1024 * 1024)
        async with Server(answering(ok(body))) as srv:
            pool = H1Pool()
            async with pool.post(srv.endpoint, "/x", {}, b"", total_s=10, connect_s=5) as resp:
                await asyncio.sleep(0.3)  # the replica sends as fast as it can; nobody reads
                transport = resp._conn.transport
                assert transport is not None and not transport.is_reading()
                assert await resp.read() == body
            await pool.close()

    run(main())


def test_unreachable_replicas_and_bad_input_are_named(run: Any) -> None:
    async def main() -> None:
        async with Server(answering(ok())) as srv:
            dead = srv.endpoint
        pool = H1Pool()
        with pytest.raises(UpstreamConnectionError, match="cannot connect"):
            await post(pool, dead)
        with pytest.raises(UpstreamConnectionError, match="not http://host:port"):
            await post(pool, "https://127.0.0.1:1")
        with pytest.raises(ValueError, match="line break"):
            pool.post(dead, "/x", {"x-request-id": "a\r\nx-evil: 1"}, b"", total_s=1, connect_s=1)
        await pool.close()

    run(main())


def test_the_pool_makes_its_sockets_with_the_factory(run: Any) -> None:
    async def main() -> None:
        async with Server(answering(ok())) as srv:
            pool = H1Pool(socket_factory=upstream_socket_factory(7))
            async with pool.post(srv.endpoint, "/x", {}, b"", total_s=10, connect_s=5) as resp:
                transport = resp._conn.transport
                assert transport is not None
                sock = transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 7000
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                await resp.read()
            await pool.close()

    run(main())


def test_an_interim_answer_is_skipped_and_the_connection_stays_usable(run: Any) -> None:
    async def main() -> None:
        async with Server(answering(b"HTTP/1.1 100 Continue\r\n\r\n" + ok())) as srv:
            pool = H1Pool()
            for _ in range(2):
                status, headers, body = await post(pool, srv.endpoint)
                assert (status, body) == (200, b'{"ok":true}') and "content-type" in headers
            assert srv.connections == 1
            await pool.close()

    run(main())
