"""The OpenAI-compatible ASGI app: dispatch and lifecycle; a proxied request runs the stages in turn.

The key (admission) → body, parse, caps, prompt length (requests) → the rate limit (admission) → hooks and
PII redaction (guardrails) → the model's queue, forward, retry, eject, relay, usage (upstream). Each stage
is one object, built with the app.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable

import aiohttp
from pydantic import BaseModel

from controlplane.errors import SarvError
from controlplane.gateway.admin import AdminListener
from controlplane.gateway.admission import Admission, ratelimit_headers
from controlplane.gateway.asgi import Receive, Scope, Send, connection, respond, respond_error
from controlplane.gateway.auth import KeyCache, TeamCache
from controlplane.gateway.config import GatewayConfig
from controlplane.gateway.discovery import Discovery
from controlplane.gateway.errors import ApiError
from controlplane.gateway.guardrails import Guardrails
from controlplane.gateway.h1 import H1Pool
from controlplane.gateway.hold import Hold
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.ratelimit import InProcessLimiter, Level, RateLimiter
from controlplane.gateway.requests import ENDPOINTS, RequestChecks, prompt_parts
from controlplane.gateway.routing import Router
from controlplane.gateway.schemas import AudioRequest, ModelCard, ModelList, openapi_document
from controlplane.gateway.upstream import Job, Upstream, trace_headers, upstream_socket_factory
from controlplane.gateway.usage import AccessLog, UsageRecorder
from controlplane.state.base import StateStore

# A raw ASGI callable rather than a framework: the hot path is one dict lookup per stage and the body bytes
# go upstream untouched (no re-serialisation), to keep the per-request CPU small.

__all__ = ["GatewayApp"]

logger = logging.getLogger(__name__)

_UPSTREAM_KEEPALIVE_S = 30.0
"""Idle connections to replicas are kept this long, by the proxy's pool and discovery's alike."""


class GatewayApp:
    """ASGI app. Inject ``store`` (replicas, keys), ``limiter``, ``session`` (discovery), the clocks and
    ``admin``, the listener that serves ``/metrics`` while the app runs (None: no metrics endpoint)."""

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
        admin: AdminListener | None = None,
    ) -> None:
        """``tune_gc``: freeze the start-up heap and collect the young generation less often. For the
        process that serves the app (``server.create_app``), not for one that merely embeds it."""
        self.config = config or GatewayConfig()
        self._tune_gc = tune_gc
        self.store = store
        self.limiter: RateLimiter = limiter or InProcessLimiter()
        self.metrics = metrics or GatewayMetrics()
        self.router = Router(self.config.routing, monotonic=monotonic)
        self.hold = Hold(
            self.config.hold,
            store=store,
            router=self.router,
            metrics=self.metrics,
            clock=clock,
            monotonic=monotonic,
        )
        self.keys = KeyCache(
            store, ttl=self.config.key_cache_ttl_s, size=self.config.key_cache_size, monotonic=monotonic
        )
        teams = TeamCache(
            store, ttl=self.config.key_cache_ttl_s, size=self.config.key_cache_size, monotonic=monotonic
        )
        self.admission = Admission(
            self.config.limits,
            keys=self.keys,
            teams=teams,
            organisation=self.config.organisation,
            limiter=self.limiter,
            router=self.router,
            metrics=self.metrics,
            clock=clock,
        )
        self.requests = RequestChecks(
            self.config,
            self.router,
            on_tokenizer=lambda model, exact: self.metrics.tokenizer_exact.labels(model).set(int(exact)),
        )
        self.upstream = Upstream(
            self.config,
            router=self.router,
            metrics=self.metrics,
            gate=self.admission.gate,
            monotonic=monotonic,
        )
        self.guardrails = Guardrails(self.config.guardrails, self.upstream.ask, metrics=self.metrics)
        self.upstream.output_filter = self.guardrails.output_filter
        self.usage = UsageRecorder(store, self.config, metrics=self.metrics, clock=clock)
        self.access_log = AccessLog(self.config.access_log) if self.config.access_log.enabled else None
        self._log_answers = self.access_log is not None and self.config.access_log.include_content
        self._mono = monotonic
        self.admin = admin
        self._session = session
        self._own_session = session is None
        self._discovery: Discovery | None = None
        self._openapi = b""
        self._started = False

    # --- lifecycle

    async def startup(self) -> None:
        """Open the upstream pool, load tokenizers, read the replicas once and start the loops."""
        if self._started:
            return
        r = self.config.routing
        await self.requests.load_tokenizers()
        sockets = upstream_socket_factory(self.config.limits.dead_peer_timeout_s)
        if self._session is None:
            # Discovery's polls. limit=0: the per-model gates bound concurrency; a cap would queue invisibly.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=0,
                    keepalive_timeout=_UPSTREAM_KEEPALIVE_S,
                    enable_cleanup_closed=True,
                    socket_factory=sockets,
                ),
                auto_decompress=False,
            )
        self.upstream.pool = H1Pool(socket_factory=sockets, keepalive_s=_UPSTREAM_KEEPALIVE_S)
        self._discovery = Discovery(
            self.store, self.router, self._session, self.metrics, monotonic=self._mono, hold=self.hold
        )
        await self._discovery.refresh()
        self._discovery.start(r.discovery_interval_s, r.scrape_interval_s)
        self._openapi = json.dumps(openapi_document()).encode()
        self.usage.start()
        if self.access_log is not None:
            self.access_log.start()
        if self.admin is not None:
            await self.admin.start(self.metrics)
        if self._tune_gc:
            _freeze_heap()
        self._started = True

    async def shutdown(self) -> None:
        if self.admin is not None:
            await self.admin.stop()
        if self._discovery is not None:
            await self._discovery.stop()
        await self.hold.close()
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
        if self.upstream.pool is not None:
            await self.upstream.pool.close()
            self.upstream.pool = None
        await self.limiter.close()
        await self.usage.close()
        if self.access_log is not None:
            await self.access_log.close()
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
                except SarvError as exc:  # the operator's mistake (a port taken): one line, no traceback
                    logger.error("gateway start-up failed: %s", exc)
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
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
        schema = ENDPOINTS.get(path)
        if schema is not None:
            if method != "POST":
                await respond_error(
                    send, ApiError(405, f"{path} accepts POST only", code="method_not_allowed")
                )
                return
            await self._proxy(scope, receive, send, path, schema)
            return
        if method not in ("GET", "HEAD"):
            await respond_error(
                send, ApiError(404 if path not in _GETS else 405, f"no route {method} {path}")
            )
            return
        if path == "/health":
            await respond(send, 200, b'{"status":"ok"}')
        elif path == "/ready":
            # A model scaled to zero is served (its requests are held while it wakes): still ready.
            serving = bool(self.router.replicas) or bool(self.hold.models)
            ok = self._discovery is not None and self._discovery.store_ok and serving
            await respond(send, 200 if ok else 503, b'{"ready":true}' if ok else b'{"ready":false}')
        elif path == "/metrics":
            # Not on the public port: the series name every key. See admin.py.
            await respond_error(
                send,
                ApiError(
                    404,
                    "no route GET /metrics on the API port: metrics are served on the gateway's metrics "
                    "listener (gateway_metrics_host:gateway_metrics_port)",
                    code="not_found",
                ),
            )
        elif path == "/openapi.json":
            await respond(send, 200, self._openapi or json.dumps(openapi_document()).encode())
        elif path == "/v1/models":
            try:
                levels = await self.admission.levels(await self.admission.authenticate(scope))
            except ApiError as exc:
                await respond_error(send, exc)
                return
            await respond(send, 200, self._model_list(levels))
        elif path.startswith("/v1/models/"):
            await self._model_card(scope, send, path[len("/v1/models/") :])
        else:
            await respond_error(send, ApiError(404, f"no route {method} {path}", code="not_found"))

    async def _model_card(self, scope: Scope, send: Send, model: str) -> None:
        """``GET /v1/models/{id}``: one model or adapter card, as in the list the key sees."""
        try:
            levels = await self.admission.levels(await self.admission.authenticate(scope))
        except ApiError as exc:
            await respond_error(send, exc)
            return
        for card in ModelList.model_validate_json(self._model_list(levels)).data:
            if card.id == model:
                await respond(send, 200, card.model_dump_json(exclude_none=True).encode())
                return
        await respond_error(
            send,
            ApiError(404, f"the model '{model}' does not exist", param="model", code="model_not_found"),
        )

    def _model_list(self, levels: tuple[Level, ...]) -> bytes:
        """The models every level (key, team, organisation) allows."""
        cards: list[ModelCard] = []
        for name, views in sorted(self.router.models().items()):
            if any(level.models and name not in level.models for level in levels):
                continue
            base = views[0].model
            cards.append(
                ModelCard(
                    id=name,
                    root=base,
                    parent=None if base == name else base,
                    max_model_len=self.requests.max_context(name),
                )
            )
        return ModelList(data=cards).model_dump_json(exclude_none=True).encode()

    # --- the proxied endpoints

    async def _held_if_zero(self, levels: tuple[Level, ...], req: BaseModel, receive: Receive) -> BaseModel:
        """``req``, once its model serves: a request for a model scaled to zero waits here (bounded)
        until a replica is ready."""
        model = str(getattr(req, "model", ""))
        if self.hold.holds(model):
            self.requests.check_allowed(levels, model)  # a 403 is not held
            await self.hold.wait(model, receive)
        return req

    def _job(self, path: str, scope: Scope) -> Job:
        job = Job(path=path, start=self._mono(), connection=connection(scope))
        job.request_id, job.headers = trace_headers(scope)
        if self._log_answers:
            job.answer = bytearray()
        return job

    async def _proxy(
        self, scope: Scope, receive: Receive, send: Send, path: str, schema: type[BaseModel]
    ) -> None:
        job = self._job(path, scope)
        status = 500
        checks = self.requests
        known = False
        try:
            record = await self.admission.authenticate(scope)
            job.key = record.name
            job.team = record.team or ""
            known = True
            levels = await self.admission.levels(record)
            body = await checks.read_body(scope, receive)
            if schema is AudioRequest:
                req: BaseModel = checks.parse_form(scope, body)
                # The form goes upstream as it came: its own content type (with the boundary).
                ctype = next(v for k, v in scope["headers"] if k == b"content-type")
                job.headers = {**job.headers, "content-type": ctype.decode("latin-1")}
            else:
                req = checks.parse(schema, body)
            job.model = checks.resolve_model(levels, await self._held_if_zero(levels, req, receive), path)
            checks.check_caps(req)
            parts = prompt_parts(req)  # once: the count, the prefix hashes and the guardrails share it
            job.info = await checks.measure(job.model, parts, req)
            job.reserve = checks.check_lengths(levels, req, job.model, job.info)
            job.usage[0] = job.info.tokens
            admitted = await self.admission.rate_limit(levels, job.team, job.reserve)
            job.reservations = admitted.reservations
            job.reply_headers = ratelimit_headers(admitted)
            if self.guardrails.active:
                body = await self.guardrails.screen_input(job.model, req, parts[0], body)
            job.body = body
            job.stream = bool(getattr(req, "stream", False))
            status = await self.upstream.admit_and_forward(receive, send, job)
        except ApiError as exc:
            status = exc.status
            if 400 <= status < 500 and status not in (401, 429):
                self.metrics.validation_rejections.labels(exc.reason).inc()
            await respond_error(send, exc, [(b"x-request-id", job.request_id.encode())])
        finally:
            if job.reservations:
                # Settled with the real usage; refused or failed after admission: what it did not use.
                used = job.usage[0] + job.usage[1] if job.forwarded else 0
                for reservation in job.reservations:
                    await self.limiter.settle(reservation, used)
            m = self.metrics
            m.child(m.requests, job.model_label, job.key, job.team, str(status)).inc()
            latency = self._mono() - job.start
            m.child(m.e2e, job.model_label).observe(latency)
            if known:
                self.usage.record(job, status)
            if self.access_log is not None:
                self.access_log.write(job, status, latency)


_GETS = frozenset({"/health", "/ready", "/openapi.json", "/v1/models"})


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
