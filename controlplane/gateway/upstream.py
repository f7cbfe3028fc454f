"""From admission to the answer: the model's queue, the upstream call, retry and ejection, relay, usage.

Every call the gateway makes to a replica on a request's behalf goes through
:meth:`Upstream.admit_and_forward`, the moderation guardrail's included (:meth:`Upstream.ask`): queued,
retried, ejected and metered alike.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controlplane.gateway.admission import Gate
from controlplane.gateway.asgi import Connection, Message, Receive, Scope, Send, respond_error
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.errors import ApiError, error_body
from controlplane.gateway.guardrails import SseRewriter, TextFilter
from controlplane.gateway.h1 import H1Pool, Response, UpstreamConnectionError
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.ratelimit import Reservation
from controlplane.gateway.routing import ReplicaView, Router
from controlplane.gateway.tokens import PromptInfo

if TYPE_CHECKING:
    from aiohappyeyeballs import AddrInfoType  # aiohttp's own dependency: the socket factory's argument
    from prometheus_client import Histogram

__all__ = [
    "ANSWER_LOG_BYTES",
    "MODERATION_KEY",
    "Flight",
    "Job",
    "Upstream",
    "openai_error",
    "trace_headers",
    "upstream_socket_factory",
    "usage_from",
]

logger = logging.getLogger(__name__)

ANSWER_LOG_BYTES = 1 << 20
"""At most this much of an answer is kept for the access log's ``response`` (``include_content``)."""

MODERATION_KEY = "gateway:moderation"
"""The ``key`` label of the moderation guardrail's own calls in the token counters."""

# Chat and completions say prompt/completion tokens; the Responses API says input/output tokens.
_PROMPT_RE = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_COMPLETION_RE = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
# Connection failures before the first byte: safe to retry elsewhere, nothing reached the client.
_RETRYABLE = (UpstreamConnectionError,)
_RETRY_STATUS = frozenset({502, 503})
_JSON_HEADERS = {"content-type": "application/json"}
_CHAT = "/v1/chat/completions"
_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:/+=-]{1,128}\Z")
# W3C Trace Context: version-traceid-parentid-flags, lower-case hex, neither id all zeros.
_TRACEPARENT = re.compile(rb"^[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}\Z")
_TRACESTATE = re.compile(rb"^[\x20-\x7e]*\Z")


@dataclass(slots=True)
class Flight:
    """Per-request state shared with the disconnect watcher."""

    done: bool = False
    """The answer is complete (or being completed): a disconnect now is the normal end."""
    started: bool = False
    """Response headers went out: no retry, no error body any more."""
    disconnected: bool = False


@dataclass(slots=True, eq=False)
class Job:
    """One proxied request as it moves through admission, routing and the relay."""

    path: str
    start: float
    key: str = "none"
    team: str = ""
    """The key's team ("" without one), the ``team`` label of the series."""
    model: str = ""
    body: bytes = b""
    stream: bool = False
    info: PromptInfo = field(default_factory=lambda: PromptInfo(0, False, []))
    reserve: int = 0
    reservations: tuple[Reservation, ...] = ()
    """One per level with limits (key, team, organisation), settled together."""
    forwarded: bool = False
    usage: list[int] = field(default_factory=lambda: [0, 0])
    """[prompt, completion] tokens: measured, then replaced by the replica's usage when it reports one."""
    flight: Flight = field(default_factory=Flight)
    filter_output: bool = True
    """Apply the output guardrails to the answer (False for the gateway's own calls)."""
    timeout: float | None = None
    """Seconds the upstream call may take in all; None: ``limits.request_timeout_s``."""
    request_id: str = ""
    """The client's valid ``X-Request-Id`` or one generated; returned to the client, sent to the replica."""
    headers: dict[str, str] = field(default_factory=lambda: _JSON_HEADERS)
    """The headers of the upstream call (content type, request id, W3C trace context)."""
    reply_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    """Added to the answer's headers (``x-ratelimit-*``)."""
    replica: str = ""
    """The replica of the last attempt (access log)."""
    attempts: int = 0
    ttft: float | None = None
    """Seconds from the request's start to the first streamed chunk."""
    connection: Connection | None = None
    """The client's connection, where the gateway's own HTTP protocol serves it (tells of its loss)."""
    answer: bytearray | None = None
    """The answer as sent to the client, kept (up to ``ANSWER_LOG_BYTES``) only for an access log with
    content; None otherwise."""

    @property
    def model_label(self) -> str:
        return self.model or "unknown"


class _Reply:
    """Collects a non-streamed answer the gateway consumes itself (the ``send`` of :meth:`Upstream.ask`)."""

    __slots__ = ("body", "status")

    def __init__(self) -> None:
        self.status = 0
        self.body = b""

    async def send(self, msg: Message) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
        else:
            self.body += msg.get("body", b"")


class Upstream:
    """The upstream stage of one gateway (built once). ``pool`` is set while the app is started;
    ``output_filter`` is the guardrails' filter of answers, if any."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        router: Router,
        metrics: GatewayMetrics,
        gate: Callable[[str], Gate],
        monotonic: Callable[[], float],
    ) -> None:
        lim = config.limits
        self._limits = lim
        self._routing = config.routing
        self._policy = config.routing.policy.value
        self._router = router
        self._metrics = metrics
        self._gate = gate
        self._mono = monotonic
        self.pool: H1Pool | None = None
        self.output_filter: TextFilter | None = None

    async def admit_and_forward(self, receive: Receive | None, send: Send, job: Job) -> int:
        """Queue for the model, then forward; the HTTP status sent. With ``receive``, a client that
        disconnects (queued or mid-answer) cancels its request: 499."""
        lim = self._limits
        gate = self._gate(job.model)
        flight = job.flight
        task = asyncio.current_task()
        watcher: asyncio.Task[None] | None = None
        conn = job.connection if receive is not None else None

        def lost() -> None:
            if not flight.done and task is not None:
                flight.disconnected = True
                task.cancel()

        # Watch from before the queue: a client that leaves while queued gives its place up at once.
        if conn is not None:  # the gateway's protocol calls back: no task per request
            if conn.lost:
                lost()
            else:
                conn.on_lost = lost
        elif receive is not None:

            async def watch() -> None:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    lost()

            watcher = asyncio.create_task(watch())
        acquired = False
        m = self._metrics
        try:
            q0 = self._mono()
            await gate.acquire(lim.queue_timeout_s, lim.retry_after_s)
            acquired = True
            m.child(m.queue, job.model).observe(self._mono() - q0)
            job.forwarded = True
            return await self.forward(send, job)
        except asyncio.CancelledError:
            if not flight.disconnected or task is None:
                raise
            # Our own watcher cancelled us: the client left. Leaving the ``async with`` of the upstream
            # response closed its connection, which is how vLLM learns to abort the request.
            task.uncancel()
            logger.debug("client disconnected; upstream request cancelled")
            return 499
        finally:
            flight.done = True
            if watcher is not None:
                watcher.cancel()
            if conn is not None and conn.on_lost is lost:
                conn.on_lost = None
            if acquired:
                gate.release()
            m.child(m.prompt_tokens, job.model, job.key, job.team).inc(job.usage[0])
            m.child(m.completion_tokens, job.model, job.key, job.team).inc(job.usage[1])

    async def forward(self, send: Send, job: Job) -> int:
        """Pick a replica and call it, retrying connection failures and 502/503 on others."""
        pool = self.pool
        if pool is None:
            raise ApiError(503, "the gateway is not started", code="not_ready")
        router = self._router
        m = self._metrics
        model = job.model
        policy = self._policy
        tried: set[str] = set()
        for attempt in range(self._routing.max_retries + 1):
            replica = router.pick(model, job.info.blocks, frozenset(tried))
            if replica is None:
                if attempt == 0:
                    raise ApiError(503, f"no ready replica for '{model}'", code="no_replica", retry_after=1)
                break
            if attempt:
                m.retries.inc()
            job.replica = replica.id
            job.attempts = attempt + 1
            m.child(m.routing_decisions, policy, replica.id).inc()
            router.on_start(replica, job.reserve, job.info.blocks)
            try:
                result = await self._call(pool, replica, send, job)
            except (*_RETRYABLE, TimeoutError) as exc:
                self.failed(replica, exc)
                if job.flight.started:
                    # Mid-answer: nothing can be retried or reported; dropping the connection tells the
                    # client the answer is incomplete (an SSE client sees no [DONE]).
                    raise
                if isinstance(exc, _RETRYABLE):
                    tried.add(replica.id)
                    continue
                raise ApiError(504, "the replica did not answer in time", code="upstream_timeout") from None
            finally:
                router.on_finish(replica, job.reserve)
            if result is None:  # a 502/503 from the replica before any byte reached the client
                self.failed(replica, RuntimeError("unavailable"))
                tried.add(replica.id)
                continue
            if result < 500:
                router.on_success(replica)
            return result
        raise ApiError(502, f"every replica of '{model}' failed", code="upstream_unavailable")

    def failed(self, replica: ReplicaView, exc: BaseException) -> None:
        """Count a failed call; the router ejects a replica that keeps failing."""
        self._metrics.upstream_errors.labels(replica.id).inc()
        if self._router.on_failure(replica):
            logger.warning("replica %s ejected after repeated failures (last: %s)", replica.id, exc)

    async def _call(self, pool: H1Pool, replica: ReplicaView, send: Send, job: Job) -> int | None:
        """One upstream attempt; None when the replica said 502/503 before anything reached the client."""
        flight = job.flight
        lim = self._limits
        total = job.timeout or lim.request_timeout_s
        async with pool.post(
            # The request's content type, id and trace headers, then the replica's engine key.
            replica.endpoint,
            job.path,
            job.headers | replica.headers,
            job.body,
            total_s=total,
            connect_s=min(total, lim.connect_timeout_s),
        ) as resp:
            status = resp.status
            if status in _RETRY_STATUS:
                await resp.read()
                return None
            if status >= 500:
                text = (await resp.read())[:500]
                self.failed(replica, RuntimeError(f"HTTP {status}"))
                logger.warning("replica %s answered %d: %r", replica.id, status, text)
                flight.done = flight.started = True
                await respond_error(
                    send,
                    ApiError(502, f"the replica failed (HTTP {status})", code="upstream_error"),
                    [(b"x-request-id", job.request_id.encode())] if job.request_id else None,
                )
                return 502
            ctype = resp.headers.get("content-type", "application/json").encode("latin-1")
            headers = [(b"content-type", ctype), (b"x-sarv-replica", replica.id.encode())]
            if job.request_id:
                headers.append((b"x-request-id", job.request_id.encode()))
            if job.reply_headers:
                headers += job.reply_headers
            if not job.stream or status != 200 or not ctype.startswith(b"text/event-stream"):
                data = await resp.read()
                if status >= 400:
                    data = openai_error(status, data, path=job.path)
                    headers[0] = (b"content-type", b"application/json")
                if self.output_filter is not None and status == 200 and job.filter_output:
                    data = SseRewriter(self.output_filter).rewrite_body(data)
                usage_from(data, job.usage)
                _keep(job.answer, data)
                headers.append((b"content-length", str(len(data)).encode()))
                flight.done = flight.started = True
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": data})
                return status
            headers.append((b"cache-control", b"no-cache"))
            headers.append((b"x-accel-buffering", b"no"))
            flight.started = True
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await self._relay(resp, send, job)
            return status

    async def _relay(self, resp: Response, send: Send, job: Job) -> None:
        """Copy an SSE body chunk by chunk as it arrives (no buffering), timing TTFT and gaps."""
        out_filter = self.output_filter if job.filter_output else None
        rewriter = SseRewriter(out_filter) if out_filter is not None else None
        m = self._metrics
        meter = _Meter(job, m.child(m.ttft, job.model), m.child(m.itl, job.model), self._mono)
        conn = job.connection
        if rewriter is None and conn is not None and conn.chunked():
            await self._pipe(resp, conn, meter)
            await send({"type": "http.response.body", "body": b""})
            return
        answer = job.answer
        read = resp.readany  # b"" is the end
        while chunk := await read():
            meter.saw(chunk)
            out = rewriter.feed(chunk) if rewriter is not None else chunk
            if out:
                _keep(answer, out)
                await send({"type": "http.response.body", "body": out, "more_body": True})
        meter.end()
        out = rewriter.close() if rewriter else b""
        _keep(answer, out)
        await send({"type": "http.response.body", "body": out})

    @staticmethod
    async def _pipe(resp: Response, conn: Connection, meter: _Meter) -> None:
        """:meth:`_relay` where the gateway's protocol serves the client and no output filter rewrites the
        answer: each piece goes from the replica's socket callback straight to the client's (a stream's
        events cost no task switch, future or ASGI message each), with the same counts and timings."""
        pipe = _Pipe(meter, conn, resp)
        try:
            await resp.pipe(pipe)
        finally:
            if pipe.waiting:
                conn.on_writable = None
        meter.end()

    async def ask(self, model: str, messages: list[dict[str, str]], timeout: float) -> str:
        """One non-streamed chat call to a Sarv-served model (the moderation hook's channel), through the
        same queue, retries, ejection and metrics as a client's request; ``timeout`` bounds the call."""
        payload = json.dumps(
            {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
        ).encode()
        job = Job(
            path=_CHAT,
            start=self._mono(),
            key=MODERATION_KEY,
            model=model,
            body=payload,
            filter_output=False,
            timeout=timeout,
        )
        reply = _Reply()
        try:
            status = await self.admit_and_forward(None, reply.send, job)
        except ApiError as exc:
            raise ApiError(
                503, f"{model} did not answer: {exc.message}", code="moderation_unavailable"
            ) from None
        except (UpstreamConnectionError, TimeoutError) as exc:
            raise ApiError(503, f"{model} did not answer: {exc}", code="moderation_unavailable") from None
        if status != 200:
            raise ApiError(503, f"{model} answered HTTP {status}", code="moderation_unavailable")
        try:
            data = json.loads(reply.body)
            return str(data["choices"][0]["message"]["content"] or "")
        except (ValueError, KeyError, IndexError, TypeError):
            raise ApiError(
                503, f"{model} answered without a verdict", code="moderation_unavailable"
            ) from None


class _Meter:
    """A streamed answer's TTFT, gaps between pieces, events and usage, piece by piece (both relays)."""

    __slots__ = ("events", "itl", "job", "last", "mono", "tail", "ttft")

    def __init__(self, job: Job, ttft: Histogram, itl: Histogram, mono: Callable[[], float]) -> None:
        self.job = job
        self.ttft = ttft
        self.itl = itl
        self.mono = mono
        self.last = 0.0
        self.events = 0
        self.tail = b""

    def saw(self, chunk: bytes) -> None:
        job = self.job
        now = self.mono()
        if self.last:
            self.itl.observe(now - self.last)
        else:
            job.ttft = now - job.start
            self.ttft.observe(job.ttft)
        self.last = now
        # One SSE event per token is vLLM's framing: a cheap completion count when usage is absent (kept
        # current, so that a client leaving mid-stream is charged for what it received).
        self.events += chunk.count(b"data: {")
        job.usage[1] = self.events
        if b'"usage":{' in chunk:
            self.tail = chunk

    def end(self) -> None:
        """The answer is complete: the replica's own usage, when it sent one, replaces the count."""
        if self.tail:
            usage_from(self.tail, self.job.usage)
        self.job.flight.done = True


def _keep(answer: bytearray | None, data: bytes) -> None:
    """Add what the client was sent to the answer kept for the access log (up to ``ANSWER_LOG_BYTES``)."""
    if answer is not None and data and len(answer) < ANSWER_LOG_BYTES:
        answer += data[: ANSWER_LOG_BYTES - len(answer)]


class _Pipe:
    """The sink of a piped stream (:meth:`Upstream._pipe`): runs in the replica connection's callback, so it
    must not raise; holds the replica back while the client's connection is paused for writing."""

    __slots__ = ("answer", "conn", "meter", "resp", "waiting")

    def __init__(self, meter: _Meter, conn: Connection, resp: Response) -> None:
        self.meter = meter
        self.conn = conn
        self.resp = resp
        self.answer = meter.job.answer
        self.waiting = False

    def __call__(self, chunk: bytes) -> None:
        self.meter.saw(chunk)
        _keep(self.answer, chunk)
        if self.conn.write_chunk(chunk) and not self.waiting:
            self.waiting = True
            self.resp.pause()
            self.conn.on_writable = self._writable

    def _writable(self) -> None:
        self.waiting = False
        self.resp.resume()


def upstream_socket_factory(dead_peer_timeout_s: float) -> Callable[[AddrInfoType], socket.socket]:
    """Sockets to replicas that notice a vanished peer (:class:`H1Pool`'s and aiohttp's ``socket_factory``):
    ``TCP_USER_TIMEOUT`` bounds unacknowledged data, keepalive probes idle pooled connections. Without
    them the kernel retransmits for ~15 minutes into a host that is gone."""
    timeout_ms = int(dead_peer_timeout_s * 1000)
    idle = max(1, int(dead_peer_timeout_s / 2))
    interval = max(1, int(dead_peer_timeout_s / 6))

    def make(addr_info: AddrInfoType) -> socket.socket:
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_USER_TIMEOUT", timeout_ms), ("TCP_KEEPIDLE", idle),
                              ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3)):  # fmt: skip
            if hasattr(socket, option):  # Linux; elsewhere the kernel's defaults stay
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        return sock

    return make


def trace_headers(scope: Scope) -> tuple[str, dict[str, str]]:
    """The request id (the client's ``X-Request-Id`` when valid, else a new one) and the upstream call's
    headers: the id, and ``traceparent``/``tracestate`` unchanged when the traceparent is valid W3C."""
    rid = parent = state = None
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            rid = value
        elif name == b"traceparent":
            parent = value
        elif name == b"tracestate":
            state = value
    request_id = rid.decode("ascii") if rid is not None and _REQUEST_ID.match(rid) else os.urandom(16).hex()
    headers = {"content-type": "application/json", "x-request-id": request_id}
    if parent is not None and _TRACEPARENT.match(parent) and not parent.startswith(b"ff"):
        headers["traceparent"] = parent.decode("ascii")
        if state is not None and len(state) <= 512 and _TRACESTATE.match(state):
            headers["tracestate"] = state.decode("ascii")
    return request_id, headers


def openai_error(status: int, data: bytes, path: str | None = None) -> bytes:
    """A replica's error answer in OpenAI's shape, its message and param kept. vLLM's ``type`` is an
    exception name and its ``code`` the HTTP status; some versions put the fields at the top level.
    A 404 without a message (the engine has no such route: ``{"detail": "Not Found"}``) names ``path``."""
    message = f"the replica refused the request (HTTP {status})"
    if status == 404 and path:
        message = f"the model's replicas do not serve {path}"
    param: str | None = None
    code: str | None = None
    try:
        doc = json.loads(data)
    except ValueError:
        doc = None
    err = doc.get("error", doc) if isinstance(doc, dict) else None
    if isinstance(err, dict):
        if isinstance(err.get("message"), str) and err["message"]:
            message = err["message"]
        if isinstance(err.get("param"), str):
            param = err["param"]
        if isinstance(err.get("code"), str):
            code = err["code"]
    elif isinstance(err, str) and err:
        message = err
    elif doc is None and data.strip() and len(data) <= 500:
        message = data.decode("utf-8", "replace").strip()
    return error_body(status, message, param=param, code=code)


def usage_from(data: bytes, usage: list[int]) -> None:
    """Take the replica's own token counts from an answer (the last ``usage`` object in it), if any."""
    p = _PROMPT_RE.findall(data)
    c = _COMPLETION_RE.findall(data)
    if p:
        usage[0] = int(p[-1])
    if c:
        usage[1] = int(c[-1])
