"""The OpenAI-compatible ASGI app: auth, limits, validation, guardrails, routing and the streaming proxy."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
from pydantic import BaseModel, ValidationError
from yarl import URL

from controlplane.errors import StateError
from controlplane.gateway.auth import KeyCache, hash_key
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.discovery import Discovery
from controlplane.gateway.errors import ApiError, error_body
from controlplane.gateway.guardrails import Guardrails, SseRewriter
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.ratelimit import InProcessLimiter, KeyLimits, RateLimiter, Reservation
from controlplane.gateway.routing import ReplicaView, Router
from controlplane.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    openapi_document,
)
from controlplane.gateway.tokens import PromptInfo, TokenCounter
from controlplane.state.base import ApiKeyRecord, StateStore

# A raw ASGI callable rather than a framework: the hot path is one dict lookup per stage and the body bytes
# go upstream untouched (no re-serialisation), to keep the per-request CPU small.

__all__ = ["GatewayApp"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_PROMPT_RE = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# pydantic's error locations include the union member tried ("prompt.list[int]"): not a field name.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")
_ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}
# Connection failures before the first byte: safe to retry elsewhere, nothing reached the client.
_RETRYABLE = (aiohttp.ClientConnectionError,)
_RETRY_STATUS = frozenset({502, 503})


class _Gate:
    """A model's admission: at most ``limit`` requests upstream, at most ``max_queue`` waiting (FIFO)."""

    __slots__ = ("active", "limit", "max_queue", "waiters")

    def __init__(self, limit: int, max_queue: int) -> None:
        self.limit = limit
        self.max_queue = max_queue
        self.active = 0
        self.waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self, timeout: float, retry_after: int) -> None:
        if self.active < self.limit and not self.waiters:
            self.active += 1
            return
        if len(self.waiters) >= self.max_queue:
            raise ApiError(
                503, "the model's queue is full; retry later", code="queue_full", retry_after=retry_after
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as we gave up: pass it on
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self.waiters.remove(fut)
            if isinstance(exc, TimeoutError):
                raise ApiError(
                    503,
                    "timed out waiting in the model's queue",
                    code="queue_timeout",
                    retry_after=retry_after,
                ) from None
            raise

    def release(self) -> None:
        # Hand the slot straight to the next live waiter; only when none is left does ``active`` drop.
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active = max(0, self.active - 1)


@dataclass(slots=True)
class _Flight:
    """Per-request state shared with the disconnect watcher."""

    done: bool = False
    """The answer is complete (or being completed): a disconnect now is the normal end."""
    started: bool = False
    """Response headers went out: no retry, no error body any more."""
    disconnected: bool = False


@dataclass(slots=True, eq=False)
class _Job:
    """One proxied request as it moves through admission, routing and the relay."""

    path: str
    start: float
    key: str = "none"
    model: str = ""
    body: bytes = b""
    stream: bool = False
    info: PromptInfo = field(default_factory=lambda: PromptInfo(0, False, []))
    reserve: int = 0
    reservation: Reservation | None = None
    forwarded: bool = False
    usage: list[int] = field(default_factory=lambda: [0, 0])
    """[prompt, completion] tokens: measured, then replaced by the replica's usage when it reports one."""
    flight: _Flight = field(default_factory=_Flight)

    @property
    def model_label(self) -> str:
        return self.model or "unknown"


class GatewayApp:
    """ASGI app. Inject ``store`` (replicas, keys), ``limiter``, ``session`` (upstream) and the clocks."""

    def __init__(
        self,
        *,
        store: StateStore,
        config: GatewayConfig | None = None,
        limiter: RateLimiter | None = None,
        session: aiohttp.ClientSession | None = None,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        tune_gc: bool = False,
    ) -> None:
        """``tune_gc``: freeze the start-up heap and collect the young generation less often. For the
        process that serves the app (``server.create_app``), not for one that merely embeds it."""
        self.config = config or GatewayConfig()
        self._tune_gc = tune_gc
        self.store = store
        self.limiter: RateLimiter = limiter or InProcessLimiter()
        self.metrics = metrics or GatewayMetrics()
        self.router = Router(self.config.routing, monotonic=monotonic)
        self.keys = KeyCache(
            store, ttl=self.config.key_cache_ttl_s, size=self.config.key_cache_size, monotonic=monotonic
        )
        self.guardrails = Guardrails(self.config.guardrails, self._ask)
        self._clock = clock
        self._mono = monotonic
        self._session = session
        self._own_session = session is None
        self._discovery: Discovery | None = None
        self._gates: dict[str, _Gate] = {}
        self._urls: dict[tuple[str, str], URL] = {}
        self._counters: dict[str, TokenCounter] = {}
        lim = self.config.limits
        r = self.config.routing
        self._default_counter = TokenCounter(
            tokenizer_path=None,
            max_bytes_per_token=lim.max_bytes_per_token,
            block_tokens=r.block_tokens,
            block_bytes=r.block_bytes,
            max_blocks=r.max_blocks,
        )
        self._timeout = aiohttp.ClientTimeout(total=lim.request_timeout_s, sock_connect=lim.connect_timeout_s)
        self._openapi = b""
        self._started = False
        self._store_warned_at = -1e18

    # --- lifecycle

    async def startup(self) -> None:
        """Open the upstream pool, load tokenizers, read the replicas once and start the loops."""
        if self._started:
            return
        lim = self.config.limits
        r = self.config.routing
        for model, over in self.config.models.items():
            if over.tokenizer is not None:
                self._counters[model] = await asyncio.to_thread(
                    TokenCounter,
                    tokenizer_path=over.tokenizer,
                    max_bytes_per_token=lim.max_bytes_per_token,
                    block_tokens=r.block_tokens,
                    block_bytes=r.block_bytes,
                    max_blocks=r.max_blocks,
                )
        if self._session is None:
            # limit=0: the per-model gates bound concurrency; a connector cap would queue invisibly.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0, enable_cleanup_closed=True),
                auto_decompress=False,
            )
        self._discovery = Discovery(
            self.store, self.router, self._session, self.metrics, monotonic=self._mono
        )
        await self._discovery.refresh()
        self._discovery.start(r.discovery_interval_s, r.scrape_interval_s)
        self._openapi = json.dumps(openapi_document()).encode()
        if self._tune_gc:
            _freeze_heap()
        self._started = True

    async def shutdown(self) -> None:
        if self._discovery is not None:
            await self._discovery.stop()
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
        await self.limiter.close()
        self._started = False

    # --- ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # reported to the server, which refuses to start
                    logger.exception("gateway start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        schema = _ENDPOINTS.get(path)
        if schema is not None:
            if method != "POST":
                await _respond_error(
                    send, ApiError(405, f"{path} accepts POST only", code="method_not_allowed")
                )
                return
            await self._proxy(scope, receive, send, path, schema)
            return
        if method not in ("GET", "HEAD"):
            await _respond_error(
                send, ApiError(404 if path not in _GETS else 405, f"no route {method} {path}")
            )
            return
        if path == "/health":
            await _respond(send, 200, b'{"status":"ok"}')
        elif path == "/ready":
            ok = self._discovery is not None and self._discovery.store_ok and bool(self.router.replicas)
            await _respond(send, 200 if ok else 503, b'{"ready":true}' if ok else b'{"ready":false}')
        elif path == "/metrics":
            await _respond(
                send,
                200,
                self.metrics.render(),
                [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
            )
        elif path == "/openapi.json":
            await _respond(send, 200, self._openapi or json.dumps(openapi_document()).encode())
        elif path == "/v1/models":
            try:
                record = await self._authenticate(scope)
            except ApiError as exc:
                await _respond_error(send, exc)
                return
            await _respond(send, 200, self._model_list(record))
        else:
            await _respond_error(send, ApiError(404, f"no route {method} {path}", code="not_found"))

    def _model_list(self, record: ApiKeyRecord) -> bytes:
        cards: list[ModelCard] = []
        for name, views in sorted(self.router.models().items()):
            if record.models and name not in record.models:
                continue
            base = views[0].model
            cards.append(
                ModelCard(
                    id=name,
                    root=base,
                    parent=None if base == name else base,
                    max_model_len=self._max_context(name),
                )
            )
        return ModelList(data=cards).model_dump_json(exclude_none=True).encode()

    # --- admission

    async def _authenticate(self, scope: Scope) -> ApiKeyRecord:
        auth: bytes | None = None
        total = 0
        for name, value in scope["headers"]:
            total += len(name) + len(value)
            if name == b"authorization":
                auth = value
        if total > self.config.limits.max_header_bytes:
            raise ApiError(
                431,
                f"request headers are {total} bytes; the limit is {self.config.limits.max_header_bytes}",
                code="headers_too_large",
                reason="headers_too_large",
            )
        if not auth or not auth[:7].lower() == b"bearer ":
            raise ApiError(
                401,
                "missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                reason="no_key",
            )
        key = auth[7:].strip().decode("latin-1")
        try:
            record = await self.keys.get(hash_key(key))
        except StateError as exc:
            # The error names the store (redacted): that is for the log; the client learns only the outage.
            if self._mono() - self._store_warned_at >= 10.0:  # one line per 10 s, not one per request
                self._store_warned_at = self._mono()
                logger.warning("cannot check API keys: %s", exc)
            raise ApiError(
                503, "cannot check the API key: the key store is unavailable", code="state_unavailable"
            ) from None
        now = self._clock()
        if record is None or record.revoked or (record.expires_at is not None and record.expires_at <= now):
            raise ApiError(
                401, "invalid, revoked or expired API key", code="invalid_api_key", reason="bad_key"
            )
        return record

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.config.limits.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise ApiError(400, "invalid Content-Length", code="invalid_request") from None
                if declared > limit:
                    raise ApiError(
                        413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large"
                    )
                break
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.config.limits.body_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise ApiError(400, "client went away", code="client_disconnected")
                    part: bytes = msg.get("body", b"")
                    size += len(part)
                    if size > limit:
                        raise ApiError(413, f"request body exceeds {limit} bytes", code="body_too_large")
                    chunks.append(part)
                    if not msg.get("more_body", False):
                        break
        except TimeoutError:
            raise ApiError(
                408,
                f"request body not received within {self.config.limits.body_timeout_s:g}s",
                code="timeout",
            ) from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _max_context(self, model: str) -> int:
        over = self.config.models.get(model)
        if over is not None and over.max_context:
            return over.max_context
        return self.router.max_context(model) or self.config.limits.default_max_context

    def _check_caps(self, req: BaseModel) -> None:
        lim = self.config.limits

        def cap(param: str, value: int | None, limit: int) -> None:
            if value is not None and value > limit:
                raise ApiError(
                    400,
                    f"'{param}' is {value}; the maximum is {limit}",
                    param=param,
                    code="invalid_value",
                    reason=param,
                )

        if isinstance(req, CompletionRequest | ChatCompletionRequest):
            cap("max_tokens", req.max_tokens, lim.max_tokens_cap)
            cap("n", req.n, lim.max_n)
            if isinstance(req.stop, list):
                cap("stop", len(req.stop), lim.max_stop_sequences)
        if isinstance(req, CompletionRequest):
            cap("best_of", req.best_of, lim.max_best_of)
            cap("logprobs", req.logprobs, lim.max_logprobs)
            if isinstance(req.prompt, list):
                cap("prompt", len(req.prompt), lim.max_prompt_items)
        elif isinstance(req, ChatCompletionRequest):
            cap("max_completion_tokens", req.max_completion_tokens, lim.max_tokens_cap)
            cap("top_logprobs", req.top_logprobs, lim.max_logprobs)
            cap("messages", len(req.messages), lim.max_prompt_items)
        elif isinstance(req, EmbeddingRequest) and isinstance(req.input, list):
            cap("input", len(req.input), lim.max_prompt_items)

    async def _measure(self, model: str, req: BaseModel) -> PromptInfo:
        texts, ids, messages = _prompt_parts(req)
        counter = self._counters.get(model, self._default_counter)
        if counter.exact and sum(len(t) for t in texts) > 16384:
            # Long prompts take milliseconds to tokenise: off the event loop (the Rust side drops the GIL).
            return await asyncio.to_thread(counter.measure, texts, ids, messages)
        return counter.measure(texts, ids, messages)

    def _parse(self, schema: type[BaseModel], body: bytes) -> BaseModel:
        try:
            return schema.model_validate_json(body)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            if err["type"] == "json_invalid":
                raise ApiError(
                    400, f"malformed JSON body: {err['msg']}", code="invalid_json", reason="invalid_json"
                ) from None
            loc = [str(p) for p in err.get("loc", ())]
            # Unions report the member type tried ("prompt.str"); name the field the client wrote.
            field = ".".join(p for p in loc if not _TYPE_TAG.match(p))
            field = field or "body"
            msg = str(err["msg"]).removeprefix("Value error, ")
            more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
            raise ApiError(
                400,
                f"invalid '{field}': {msg}{more}",
                param=field,
                code="invalid_value",
                reason="invalid_field",
            ) from None

    # --- the proxied endpoints

    async def _proxy(
        self, scope: Scope, receive: Receive, send: Send, path: str, schema: type[BaseModel]
    ) -> None:
        job = _Job(path=path, start=self._mono())
        status = 500
        try:
            record = await self._authenticate(scope)
            job.key = record.name
            body = await self._read_body(scope, receive)
            req = self._parse(schema, body)
            job.model = self._resolve_model(record, req)
            self._check_caps(req)
            job.info = await self._measure(job.model, req)
            job.reserve = self._check_lengths(record, req, job.model, job.info)
            job.usage[0] = job.info.tokens
            job.reservation = await self._rate_limit(record, job.reserve)
            if self.guardrails.active:
                body = await self._guard_input(job.model, req, body)
            job.body = body
            job.stream = bool(getattr(req, "stream", False))
            status = await self._admit_and_forward(receive, send, job)
        except ApiError as exc:
            status = exc.status
            if 400 <= status < 500 and status not in (401, 429):
                self.metrics.validation_rejections.labels(exc.reason).inc()
            await _respond_error(send, exc)
        finally:
            if job.reservation is not None:
                # Refused or failed after admission: give back what it did not use.
                await self.limiter.settle(
                    job.reservation, job.usage[0] + job.usage[1] if job.forwarded else 0
                )
            m = self.metrics
            m.child(m.requests, job.model_label, job.key, str(status)).inc()
            m.child(m.e2e, job.model_label).observe(self._mono() - job.start)

    def _resolve_model(self, record: ApiKeyRecord, req: BaseModel) -> str:
        model = str(getattr(req, "model", ""))
        if not self.router.serves(model):
            raise ApiError(
                404,
                f"the model '{model}' does not exist or has no ready replica",
                param="model",
                code="model_not_found",
                reason="unknown_model",
            )
        if record.models and model not in record.models:
            raise ApiError(
                403,
                f"this API key may not use the model '{model}'",
                param="model",
                code="model_not_allowed",
                reason="model_not_allowed",
            )
        return model

    def _check_lengths(self, record: ApiKeyRecord, req: BaseModel, model: str, info: PromptInfo) -> int:
        """Refuse prompts over the context or the key's cap; return the tokens to reserve."""
        context = self._max_context(model)
        bound = "" if info.exact else "at least "
        param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if info.tokens > context:
            raise ApiError(
                400,
                f"the prompt is {bound}{info.tokens} tokens; the model '{model}' accepts at most {context}",
                param=param,
                code="context_length_exceeded",
                reason="context_length",
            )
        cap = record.max_prompt_tokens
        if cap is not None and info.tokens > cap:
            raise ApiError(
                400,
                f"the prompt is {bound}{info.tokens} tokens; this API key allows at most {cap}",
                param=param,
                code="prompt_too_long",
                reason="key_prompt_cap",
            )
        if isinstance(req, EmbeddingRequest):
            return info.tokens
        asked: int | None = None
        ways = 1
        if isinstance(req, CompletionRequest):
            asked = req.max_tokens
            ways = max(req.n, req.best_of or 1)
        elif isinstance(req, ChatCompletionRequest):
            asked = req.max_tokens or req.max_completion_tokens
            ways = req.n
        if asked is not None and info.tokens + asked > context:
            raise ApiError(
                400,
                f"the prompt ({bound}{info.tokens} tokens) plus max_tokens ({asked}) exceeds "
                f"the context of '{model}' ({context} tokens)",
                param="max_tokens",
                code="context_length_exceeded",
                reason="context_length",
            )
        return info.tokens + (asked or self.config.limits.default_max_tokens) * ways

    async def _rate_limit(self, record: ApiKeyRecord, reserve: int) -> Reservation | None:
        limits = KeyLimits(record.rpm, record.tpm, record.daily_tokens)
        if limits.unlimited:
            return None
        m = self.metrics
        # The hash prefix, not the name: names may hold characters that clash with Redis hash tags.
        decision = await self.limiter.admit(record.key_hash[:24], limits, reserve, self._clock())
        if decision.backend_error:
            m.limiter_errors.labels("admitted" if decision.allowed else "refused").inc()
        if decision.allowed:
            return decision.reservation
        if decision.backend_error:
            raise ApiError(
                503, "the rate limiter is unavailable", code="ratelimit_unavailable", retry_after=1
            )
        m.ratelimit_rejections.labels(record.name, decision.reason or "unknown").inc()
        raise ApiError(
            429,
            f"rate limit exceeded ({decision.reason}); retry after {decision.retry_after:.0f}s",
            code="rate_limit_exceeded",
            retry_after=decision.retry_after,
            reason="ratelimit",
        )

    async def _guard_input(self, model: str, req: BaseModel, body: bytes) -> bytes:
        texts = _prompt_parts(req)[0]
        for hook in self.guardrails.pre:
            try:
                await hook(model, texts)
            except ApiError as exc:
                self.metrics.guardrail_actions.labels(hook.name, "refused").inc()
                raise exc from None
        if self.guardrails.input_filter is not None:
            obj = json.loads(body)
            if self.guardrails.redact_input(obj):
                self.metrics.guardrail_actions.labels("pii_input", "redacted").inc()
                return json.dumps(obj).encode()
        return body

    def _gate(self, model: str) -> _Gate:
        lim = self.config.limits
        limit = max(1, int(self.router.capacity(model) * lim.max_outstanding_per_replica))
        gate = self._gates.get(model)
        if gate is None:
            gate = self._gates[model] = _Gate(limit, lim.max_queue_per_model)
        gate.limit = limit  # follows the replica set
        return gate

    async def _admit_and_forward(self, receive: Receive, send: Send, job: _Job) -> int:
        lim = self.config.limits
        gate = self._gate(job.model)
        flight = job.flight
        task = asyncio.current_task()

        async def watch() -> None:
            msg = await receive()
            if msg["type"] == "http.disconnect" and not flight.done and task is not None:
                flight.disconnected = True
                task.cancel()

        # Watch from before the queue: a client that leaves while queued gives its place up at once.
        watcher = asyncio.create_task(watch())
        acquired = False
        try:
            q0 = self._mono()
            await gate.acquire(lim.queue_timeout_s, lim.retry_after_s)
            acquired = True
            self.metrics.child(self.metrics.queue, job.model).observe(self._mono() - q0)
            job.forwarded = True
            return await self._forward(send, job)
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
            watcher.cancel()
            if acquired:
                gate.release()
            m = self.metrics
            m.child(m.prompt_tokens, job.model, job.key).inc(job.usage[0])
            m.child(m.completion_tokens, job.model, job.key).inc(job.usage[1])

    async def _forward(self, send: Send, job: _Job) -> int:
        session = self._session
        if session is None:
            raise ApiError(503, "the gateway is not started", code="not_ready")
        router = self.router
        m = self.metrics
        model = job.model
        policy = self.config.routing.policy.value
        tried: set[str] = set()
        for attempt in range(self.config.routing.max_retries + 1):
            replica = router.pick(model, job.info.blocks, frozenset(tried))
            if replica is None:
                if attempt == 0:
                    raise ApiError(503, f"no ready replica for '{model}'", code="no_replica", retry_after=1)
                break
            if attempt:
                m.retries.inc()
            m.child(m.routing_decisions, policy, replica.id).inc()
            router.on_start(replica, job.reserve, job.info.blocks)
            try:
                result = await self._call(session, replica, send, job)
            except (*_RETRYABLE, TimeoutError) as exc:
                self._failed(replica, exc)
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
                self._failed(replica, RuntimeError("unavailable"))
                tried.add(replica.id)
                continue
            if result < 500:
                router.on_success(replica)
            return result
        raise ApiError(502, f"every replica of '{model}' failed", code="upstream_unavailable")

    def _failed(self, replica: ReplicaView, exc: BaseException) -> None:
        self.metrics.upstream_errors.labels(replica.id).inc()
        if self.router.on_failure(replica):
            logger.warning("replica %s ejected after repeated failures (last: %s)", replica.id, exc)

    async def _call(
        self, session: aiohttp.ClientSession, replica: ReplicaView, send: Send, job: _Job
    ) -> int | None:
        """One upstream attempt; None when the replica said 502/503 before anything reached the client."""
        flight = job.flight
        url = self._urls.get((replica.endpoint, job.path))
        if url is None:  # parsed once per replica and endpoint, not per request
            if len(self._urls) >= 4096:  # replicas come and go: start over rather than grow
                self._urls.clear()
            url = self._urls[(replica.endpoint, job.path)] = URL(replica.endpoint + job.path)
        async with session.post(url, data=job.body, headers=_JSON_HEADERS, timeout=self._timeout) as resp:
            status = resp.status
            if status in _RETRY_STATUS:
                await resp.read()
                return None
            if status >= 500:
                text = (await resp.read())[:500]
                self._failed(replica, RuntimeError(f"HTTP {status}"))
                logger.warning("replica %s answered %d: %r", replica.id, status, text)
                flight.done = flight.started = True
                await _respond_error(
                    send, ApiError(502, f"the replica failed (HTTP {status})", code="upstream_error")
                )
                return 502
            ctype = resp.headers.get("content-type", "application/json").encode("latin-1")
            headers = [(b"content-type", ctype), (b"x-sarv-replica", replica.id.encode())]
            if not job.stream or status != 200 or not ctype.startswith(b"text/event-stream"):
                data = await resp.read()
                if self.guardrails.output_filter is not None and status == 200:
                    data = SseRewriter(self.guardrails.output_filter).rewrite_body(data)
                _usage_from(data, job.usage)
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

    async def _relay(self, resp: aiohttp.ClientResponse, send: Send, job: _Job) -> None:
        """Copy an SSE body chunk by chunk as it arrives (no buffering), timing TTFT and gaps."""
        out_filter = self.guardrails.output_filter
        rewriter = SseRewriter(out_filter) if out_filter is not None else None
        m = self.metrics
        ttft = m.child(m.ttft, job.model)
        itl = m.child(m.itl, job.model)
        mono = self._mono
        last = 0.0
        events = 0
        tail = b""
        read = resp.content.readany  # iter_any() without its iterator wrapper: b"" is the end
        while chunk := await read():
            now = mono()
            if last:
                itl.observe(now - last)
            else:
                ttft.observe(now - job.start)
            last = now
            # One SSE event per token is vLLM's framing: a cheap completion count when usage is absent
            # (kept current, so that a client leaving mid-stream is charged for what it received).
            events += chunk.count(b"data: {")
            job.usage[1] = events
            if b'"usage":{' in chunk:
                tail = chunk
            out = rewriter.feed(chunk) if rewriter is not None else chunk
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        if tail:
            _usage_from(tail, job.usage)
        job.flight.done = True
        await send({"type": "http.response.body", "body": rewriter.close() if rewriter else b""})

    async def _ask(self, model: str, messages: list[dict[str, str]], timeout: float) -> str:
        """One non-streamed chat call to a Sarv-served model (the moderation hook's channel)."""
        session = self._session
        replica = self.router.pick(model, [])
        if session is None or replica is None:
            raise ApiError(503, f"no ready replica for '{model}'", code="no_replica")
        payload = json.dumps(
            {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
        ).encode()
        try:
            async with session.post(
                replica.endpoint + "/v1/chat/completions",
                data=payload,
                headers=_JSON_HEADERS,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ApiError(503, f"{model} did not answer: {exc}", code="moderation_unavailable") from None
        try:
            return str(data["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            raise ApiError(
                503, f"{model} answered without a verdict", code="moderation_unavailable"
            ) from None


_JSON_HEADERS = {"content-type": "application/json"}
_GETS = frozenset({"/health", "/ready", "/metrics", "/openapi.json", "/v1/models"})


def _freeze_heap() -> None:
    """Keep the collector off the request path.

    The modules and caches loaded at start-up (~60k objects) never die, yet every full collection walks
    them: a 10-20 ms stop of the event loop, in the p99 of whichever requests were in flight. Frozen,
    they are exempt; a larger young generation makes the remaining collections rarer (requests free
    their objects by reference counting, and the cycles they leave are few).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_GEN0, 20, 20)


_GC_GEN0 = 20_000


def _prompt_parts(req: BaseModel) -> tuple[list[str], list[list[int]], int]:
    """(texts, token-id prompts, number of chat messages) of a validated request."""
    texts: list[str] = []
    ids: list[list[int]] = []
    if isinstance(req, ChatCompletionRequest):
        for m in req.messages:
            if isinstance(m.content, str):
                texts.append(m.content)
            else:
                texts.append("".join(p.text or "" for p in m.content or ()))
        return texts, ids, len(req.messages)
    if isinstance(req, CompletionRequest | EmbeddingRequest):
        prompt = req.prompt if isinstance(req, CompletionRequest) else req.input
        if isinstance(prompt, str):
            return [prompt], ids, 0
        for item in prompt:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, int):
                return texts, [cast("list[int]", prompt)], 0
            else:
                ids.append(item)
    return texts, ids, 0


def _usage_from(data: bytes, usage: list[int]) -> None:
    p = _PROMPT_RE.findall(data)
    c = _COMPLETION_RE.findall(data)
    if p:
        usage[0] = int(p[-1])
    if c:
        usage[1] = int(c[-1])


async def _respond(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    hdrs = list(headers or _JSON)
    hdrs.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


async def _respond_error(send: Send, exc: ApiError) -> None:
    headers = list(_JSON)
    if exc.retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(exc.retry_after))).encode()))
    await _respond(
        send, exc.status, error_body(exc.status, exc.message, param=exc.param, code=exc.code), headers
    )
