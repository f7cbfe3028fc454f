"""A light HTTP/1.1 load generator: Poisson arrivals on a seeded schedule, driven from protocol callbacks.

The aiohttp closed loop in ``common.py`` spends ~0.4 s of CPU per second at 200 streams of the h100-8b
profile (16,700 SSE events/s), on the core it shares with the simulator: that core runs ~90 % busy and the
client's own queueing moves the direct run's TTFT p50 by tens of milliseconds between repetitions. And a
closed loop against a fixed-latency upstream falls into lockstep: clients that finish together (after any
pause) start together from then on, so bursts only grow over a run, differently in every run.

Here each request is sent at its time on a schedule of exponential gaps (Poisson arrivals, an open loop), the
same schedule for every target of a repetition, so targets are compared on identical arrivals; and a request
costs a few callbacks: the response is parsed by httptools (llhttp, C) in the connection's ``data_received``,
without a task, future or stream reader per request. Connections are kept alive and reused; enough are
opened before the run that none is opened inside it (one is, if the pool runs dry, and counted).

The rate for "N streams" follows Little's law: N ÷ one request's duration at the upstream, so that on
average N requests are in flight (``mean_in_flight`` reports what was measured: arrivals × mean latency).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools
from common import Sample, pct


def schedule(rate: float, seconds: float, seed: int) -> list[float]:
    """Arrival offsets in seconds: exponential gaps of mean ``1 / rate`` over ``seconds``."""
    rng = random.Random(seed)
    out: list[float] = []
    t = rng.expovariate(rate)
    while t < seconds:
        out.append(t)
        t += rng.expovariate(rate)
    return out


class _Conn(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time; the parser calls back into it."""

    def __init__(self, gen: _Run) -> None:
        self.gen = gen
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.now = 0.0
        self.t0 = 0.0
        self.first = 0.0
        self.chunks = 0
        self.status = 0
        self.index = -1

    # --- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._done(False)
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.gen.conns.discard(self)
        if self.busy:
            self.now = time.perf_counter()
            self._done(False)
        self.transport = None

    # --- httptools callbacks

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self.chunks:
            self.first = self.now
        self.chunks += 1

    def on_message_complete(self) -> None:
        keep = self.parser.should_keep_alive()
        self._done(self.status == 200)
        if not keep:
            self._close()

    # ---

    def send(self, index: int, payload: bytes) -> None:
        assert self.transport is not None
        self.busy = True
        self.index = index
        self.chunks = 0
        self.status = 0
        self.t0 = time.perf_counter()
        self.transport.write(payload)

    def _done(self, ok: bool) -> None:
        if not self.busy:
            return
        self.busy = False
        end = self.now
        # Streamed: the first body bytes; whole: the complete answer (as the aiohttp client measures).
        ttft = (self.first if self.gen.stream and self.chunks else end) - self.t0
        sample = Sample(ok, self.status, ttft if ok else 0.0, end - self.t0, self.chunks)
        self.gen.finished(self, self.index, sample)

    def _close(self) -> None:
        self.gen.conns.discard(self)
        if self.transport is not None:
            self.transport.close()


@dataclass
class Result:
    samples: list[Sample]
    """Requests sent in the measured window."""
    window_s: float
    completed_in_window: int
    sent: int
    """All requests of the run, warm-up included."""
    completed: int
    """Of those, the ones answered 200 (for CPU per request)."""
    late_p99_ms: float
    """How late the client sent requests against the schedule (its own queueing), 99th percentile."""
    opened_in_run: int
    """Connections opened after the run started (the pool ran dry)."""
    mean_in_flight: float


class _Run:
    def __init__(self, stream: bool, window: tuple[float, float]) -> None:
        self.stream = stream
        self.window = window
        self.conns: set[_Conn] = set()
        self.idle: list[_Conn] = []
        self.samples: list[Sample | None] = []
        self.late: list[float] = []
        self.pending = 0
        self.completed = 0
        self.completed_in_window = 0
        self.opened = 0
        self.all_done: asyncio.Future[None] | None = None

    def take(self) -> _Conn | None:
        """The most recently used idle connection still open (a server may close idle ones: uvicorn
        after 5 s), or None."""
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    def finished(self, conn: _Conn, index: int, sample: Sample) -> None:
        self.samples[index] = sample
        self.pending -= 1
        if sample.ok:
            self.completed += 1
            if self.window[0] <= time.perf_counter() <= self.window[1]:
                self.completed_in_window += 1
        if conn.transport is not None and conn in self.conns:
            self.idle.append(conn)
        if not self.pending and self.all_done is not None and not self.all_done.done():
            self.all_done.set_result(None)


async def open_loop(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    stream: bool,
    rate: float,
    duration: float,
    warmup: float,
    seed: int,
    pool: int,
    timeout: float = 120.0,
) -> Result:
    """Requests at Poisson arrivals of ``rate``/s for ``warmup + duration`` s; samples of those in the window.

    Requests still unanswered ``timeout`` s after the last arrival count as failed.
    """
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    payload = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {host}:{port}\r\n{head}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    arrivals = schedule(rate, warmup + duration, seed)
    run = _Run(stream, (0.0, 0.0))

    async def connect() -> None:
        _, conn = await loop.create_connection(lambda: _Conn(run), host, port)
        run.conns.add(conn)
        run.idle.append(conn)

    await asyncio.gather(*(connect() for _ in range(pool)))
    start = time.perf_counter()
    run.window = (start + warmup, start + warmup + duration)
    measured: list[int] = []
    run.samples = [None] * len(arrivals)
    waiting: list[int] = []  # requests whose connection is still being opened

    def fire(i: int) -> None:
        now = time.perf_counter()
        run.late.append(now - (start + arrivals[i]))
        run.pending += 1
        if arrivals[i] >= warmup:
            measured.append(i)
        conn = run.take()
        if conn is not None:
            conn.send(i, payload)
            return
        run.opened += 1
        waiting.append(i)
        loop.create_task(connect()).add_done_callback(opened)

    def opened(task: asyncio.Task[None]) -> None:
        j = waiting.pop(0)
        conn = run.take() if task.exception() is None else None
        if conn is None:
            run.pending -= 1  # counted as failed: its sample stays empty
            return
        conn.send(j, payload)

    t_loop = loop.time()
    for i, a in enumerate(arrivals):
        loop.call_at(t_loop + a, fire, i)
    await asyncio.sleep(warmup + duration)
    if run.pending:
        run.all_done = loop.create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(run.all_done), timeout)
    for conn in list(run.conns):
        conn._close()
    failed = Sample(False, 0, 0.0, timeout)
    samples = [s if s is not None else failed for s in (run.samples[i] for i in measured)]
    ok = [s.e2e for s in run.samples if s is not None and s.ok]
    return Result(
        samples=samples,
        window_s=duration,
        completed_in_window=run.completed_in_window,
        sent=len(arrivals),
        completed=run.completed,
        late_p99_ms=pct(run.late, 99) * 1000 if run.late else 0.0,
        opened_in_run=run.opened,
        mean_in_flight=len(arrivals) / (warmup + duration) * (sum(ok) / len(ok)) if ok else 0.0,
    )
