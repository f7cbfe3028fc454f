"""A streamed answer piped from the replica's socket to the client's (upstream.Upstream._pipe): a client
that stops reading holds the replica back (TCP back-pressure through the gateway, nothing piles up in it),
and the answer arrives whole once it reads again."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import pytest
from fixtures.common import http_server
from fixtures.gateway import add_key, add_replica, make_store

CHUNKS = 2048
"""Events of 64 KiB each: 128 MiB, several times what the sockets and buffers between can hold."""
_EVENT = b'data: {"choices":[{"text":"' + b"a" * (64 * 1024 - 40) + b'"}]}\n\n'


class _Firehose(BaseHTTPRequestHandler):
    """A replica that streams ``CHUNKS`` large SSE events as fast as its socket takes them."""

    protocol_version = "HTTP/1.1"
    sent: ClassVar[list[int]] = [0]

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = b'{"object":"list","data":[]}' if self.path.startswith("/v1") else b""
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        try:
            for _ in range(CHUNKS):
                self.wfile.write(b"%x\r\n%b\r\n" % (len(_EVENT), _EVENT))  # blocks while the peer is full
                self.sent[0] += len(_EVENT)
            done = b"data: [DONE]\n\n"
            self.wfile.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
        except OSError:
            pass


@pytest.fixture
def firehose(tmp_path, gateway_factory) -> Iterator[tuple[Any, str]]:
    _Firehose.sent[0] = 0
    with http_server(_Firehose) as port:
        store = make_store(tmp_path)
        add_replica(store, f"http://127.0.0.1:{port}", "fire", rid="fire-0")
        key = add_key(store, "reader")
        yield gateway_factory(store), key


def _read_until(s: socket.socket, marker: bytes, limit: int) -> bytes:
    data = b""
    while marker not in data and len(data) < limit:
        part = s.recv(1 << 20)
        if not part:
            break
        data += part
    return data


def test_a_client_that_stops_reading_holds_the_replica_back_and_then_gets_every_byte(firehose):
    gw, key = firehose
    body = json.dumps({"model": "fire", "prompt": "x", "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = _read_until(s, b"\r\n\r\n", 1 << 16)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        # The client reads nothing more: the replica fills what lies between and then stops.
        time.sleep(2.0)
        stalled = _Firehose.sent[0]
        time.sleep(1.5)
        assert _Firehose.sent[0] == stalled, "the replica kept sending to a client that does not read"
        total = CHUNKS * len(_EVENT)
        assert stalled < total // 2, f"{stalled} of {total} bytes left the replica unread by the client"
        # Reading again resumes the replica; every event arrives, in order, then the end of the stream.
        rest = head.split(b"\r\n\r\n", 1)[1]
        chunks = [rest]
        seen = len(rest)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            part = s.recv(1 << 20)
            if not part:
                break
            chunks.append(part)
            seen += len(part)
            if part.endswith(b"0\r\n\r\n") and b"[DONE]" in b"".join(chunks[-2:]):
                break
    stream = b"".join(chunks)
    assert stream.count(b'data: {"choices"') == CHUNKS
    assert stream.rstrip().endswith(b"0"), stream[-64:]
    assert b"data: [DONE]" in stream[-64:]
    assert _Firehose.sent[0] == total


def test_the_pipe_pauses_the_replica_once_while_the_client_is_full_and_counts_what_passes():
    """The sink on its own: the client's connection reports itself full, the pipe pauses the replica once
    and resumes it from on_writable; TTFT, gaps, events and the replica's usage as in the relay."""
    from controlplane.gateway.upstream import Job, _Meter, _Pipe

    class Conn:
        def __init__(self) -> None:
            self.full = False
            self.on_writable: Any = None
            self.written: list[bytes] = []

        def write_chunk(self, data: bytes) -> bool:
            self.written.append(data)
            return self.full

    class Resp:
        def __init__(self) -> None:
            self.paused = 0
            self.resumed = 0

        def pause(self) -> None:
            self.paused += 1

        def resume(self) -> None:
            self.resumed += 1

    class Hist:
        def __init__(self) -> None:
            self.seen: list[float] = []

        def observe(self, v: float) -> None:
            self.seen.append(v)

    clock = iter(float(i) for i in range(10, 100))
    job = Job(path="/v1/completions", start=9.0)
    conn, resp, ttft, itl = Conn(), Resp(), Hist(), Hist()
    meter = _Meter(job, ttft, itl, lambda: next(clock))  # type: ignore[arg-type]
    pipe = _Pipe(meter, conn, resp)  # type: ignore[arg-type]
    pipe(b'data: {"a":1}\n\n')
    conn.full = True
    pipe(b'data: {"a":2}\n\ndata: {"a":3}\n\n')
    pipe(b'data: {"a":4,"usage":{"prompt_tokens":3,"completion_tokens":7}}\n\n')
    assert (resp.paused, resp.resumed) == (1, 0), "paused once, however many writes meet a full client"
    conn.full = False
    conn.on_writable()
    assert (resp.paused, resp.resumed) == (1, 1)
    assert ttft.seen == [1.0] and itl.seen == [1.0, 1.0]
    assert job.usage[1] == 4, "events counted as they pass"
    meter.end()
    assert job.usage == [3, 7] and job.flight.done, "the replica's usage replaces the count at the end"
    assert len(conn.written) == 3
