"""Builds the gateway from settings (store, limiter) and serves it with uvicorn's production settings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.supervisors.multiprocess import Multiprocess

from controlplane.errors import ConfigError
from controlplane.gateway.admin import AdminListener, read_token
from controlplane.gateway.app import GatewayApp
from controlplane.gateway.asgi import CONNECTION
from controlplane.gateway.config import load_gateway_config
from controlplane.gateway.errors import error_body
from controlplane.gateway.ratelimit import InProcessLimiter, RateLimiter, RedisLimiter
from controlplane.gateway.tls import TlsContextFactory, TlsFiles
from controlplane.settings import Settings, load_settings
from controlplane.state.clients import async_client, is_redis_url, redis_endpoint

__all__ = ["admin_listener", "build_app", "create_app", "serve"]

logger = logging.getLogger(__name__)

# The config file path and the worker count travel to uvicorn's worker processes in the environment.
_CONFIG_ENV = "SARV_GATEWAY_CONFIG"
_WORKERS_ENV = "SARV_GATEWAY_WORKERS"


def _limiter(settings: Settings) -> RateLimiter:
    url = settings.resolved_state_url
    if not is_redis_url(url):
        # SQLite (embedded default): one gateway process, so an in-process limiter has the same semantics.
        return InProcessLimiter()
    client = async_client(
        redis_endpoint(url, settings), timeout_s=0.5, max_connections=64, pool_timeout_s=1.0
    )
    return RedisLimiter(
        client,
        prefix=settings.state_prefix,
        fail_open=settings.ratelimit_fail_open,
        lease_fraction=settings.ratelimit_lease_fraction,
    )


def admin_listener(settings: Settings, *, workers: int = 1) -> AdminListener | None:
    """The metrics listener the settings ask for (None with ``gateway_metrics_port`` 0)."""
    if settings.gateway_metrics_port == 0:
        return None
    return AdminListener(
        host=settings.gateway_metrics_host,
        port=settings.gateway_metrics_port,
        token=read_token(settings.gateway_metrics_token_file),
        reuse_port=workers > 1,
    )


def build_app(
    settings: Settings, config_path: Path | None = None, *, tune_gc: bool = False, workers: int = 1
) -> GatewayApp:
    """The app for these settings; nothing connects or listens until the ASGI lifespan starts it."""
    from controlplane.state import open_store

    config = load_gateway_config(config_path)
    if config.model_cache is None:
        config = config.model_copy(update={"model_cache": settings.resolved_model_cache})
    admin = admin_listener(settings, workers=workers)
    store = open_store(settings.resolved_state_url, settings)
    return GatewayApp(store=store, config=config, limiter=_limiter(settings), tune_gc=tune_gc, admin=admin)


_REQUEST_LINE_BYTES = 8192
_LINGER_S = 5.0


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines on each request's head and body, and the connection's
    loss told to the request being served (:class:`~controlplane.gateway.asgi.Connection`).

    uvicorn bounds the idle time between requests but not the time a client takes to send its headers:
    one that trickles a byte now and then, or connects and sends nothing, would hold its connection for
    ever. The head deadline runs from the connection's opening, and from each later request's first byte,
    to the end of its headers; past it the client gets 408 and the connection is closed. The body's
    deadline is set by the app when it starts reading (:meth:`expect_body`); a body already received,
    the usual case, costs no timer.

    It reads uvicorn's request cycle (``more_body``, ``response_started``/``response_complete``,
    ``chunked_encoding``, ``message_event``) and flow control (``write_paused``), internals that uvicorn
    0.30 to 0.55 share; the gateway's tests serve through this protocol, so an upgrade that changes them
    fails there first.
    """

    head_timeout_s: float = 10.0
    """Set by :func:`create_app` from ``limits.header_timeout_s`` (one gateway per process)."""
    head_max_bytes: int = 16384 + _REQUEST_LINE_BYTES
    """Set by :func:`create_app`: ``limits.max_header_bytes`` plus room for the request line."""

    _head_deadline: asyncio.TimerHandle | None = None
    _body_deadline: asyncio.TimerHandle | None = None
    _head_bytes = 0
    _lingering = False
    lost = False
    on_lost: Callable[[], None] | None = None
    on_writable: Callable[[], None] | None = None
    body_expired = False

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # refused: what the client still sends is read and dropped (see _refuse)
        super().data_received(data)
        if self._head_deadline is None or self.transport.is_closing():
            return
        # Still inside a request's head, so all of ``data`` was head. httptools keeps whatever it is
        # sent; refuse while receiving rather than after the last header line.
        self._head_bytes += len(data)
        if self._head_bytes > self.head_max_bytes:
            self._disarm_head_deadline()
            self._refuse(431, f"request headers exceed {self.head_max_bytes} bytes", "headers_too_large")

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        # uvicorn types extensions as dicts of dicts; the app reads this entry as a Connection (asgi.py).
        self.scope["extensions"] = {CONNECTION: self}  # type: ignore[dict-item]
        self.body_expired = False
        self._arm_head_deadline()

    def on_headers_complete(self) -> None:
        self._disarm_head_deadline()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm_body_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        self._disarm_body_deadline()
        super().connection_lost(exc)
        self.lost = True
        self.on_writable = None
        callback, self.on_lost = self.on_lost, None
        if callback is not None:
            callback()

    def chunked(self) -> bool:
        cycle = self.cycle
        return (
            cycle is not None
            and cycle.response_started
            and bool(cycle.chunked_encoding)
            and not cycle.response_complete
            and cycle.scope["method"] != "HEAD"
        )

    def write_chunk(self, data: bytes) -> bool:
        transport = self.transport
        if data and not transport.is_closing():
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))  # uvicorn's own chunk framing
        return self.flow.write_paused

    def resume_writing(self) -> None:
        super().resume_writing()
        callback, self.on_writable = self.on_writable, None
        if callback is not None:
            callback()

    def expect_body(self, timeout_s: float) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.more_body and self._body_deadline is None and not self.lost:
            self._body_deadline = self.loop.call_later(timeout_s, self._body_timed_out)

    def _disarm_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_timed_out(self) -> None:
        self._body_deadline = None
        self.body_expired = True
        if self.cycle is not None:
            self.cycle.message_event.set()  # the app's receive() returns, and sees body_expired

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_deadline(self) -> None:
        self._head_bytes = 0
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        self._refuse(408, "request headers not received in time", "timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer in OpenAI's error shape and close: the request never reached the app."""
        if self.transport.is_closing():
            return
        body = error_body(status, message, code=code)
        self.transport.write(
            STATUS_LINE[status]
            + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            + body
        )
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # A lingering close, as nginx does: closing with the client's bytes still unread would reset the
        # connection, and the client could lose the answer. Send FIN after it, drop what still comes,
        # and close when the client does or after a few seconds.
        self.transport.write_eof()
        self._lingering = True
        self.loop.call_later(_LINGER_S, self.transport.close)


def create_app() -> GatewayApp:
    """uvicorn factory (``--workers`` > 1 imports this in every worker)."""
    path = os.environ.get(_CONFIG_ENV)
    workers = int(os.environ.get(_WORKERS_ENV, "1"))
    app = build_app(load_settings(), Path(path) if path else None, tune_gc=True, workers=workers)
    GatewayHttpProtocol.head_timeout_s = app.config.limits.header_timeout_s
    GatewayHttpProtocol.head_max_bytes = app.config.limits.max_header_bytes + _REQUEST_LINE_BYTES
    return app


def serve(
    settings: Settings,
    *,
    host: str,
    port: int,
    workers: int,
    config_path: Path | None,
    tls: TlsFiles | None = None,
) -> None:
    """Run uvicorn (uvloop + httptools, no access log) until interrupted; HTTPS with ``tls``.

    The metrics listener comes from ``settings`` (``gateway_metrics_*``), read again by each worker.
    """
    import uvicorn

    if workers > 1 and not is_redis_url(settings.resolved_state_url):
        raise ConfigError(
            f"--workers {workers} needs Redis state (rate limits are shared only through Redis)",
            hint="set SARV_STATE_URL=redis://… or run one worker",
        )
    admin_listener(settings)  # the token file: fail here, with one line, rather than in every worker
    # Workers read their settings again: the effective metrics address (options included) goes with them.
    os.environ[_WORKERS_ENV] = str(workers)
    os.environ["SARV_GATEWAY_METRICS_HOST"] = settings.gateway_metrics_host
    os.environ["SARV_GATEWAY_METRICS_PORT"] = str(settings.gateway_metrics_port)
    if config_path is not None:
        load_gateway_config(config_path)  # fail here, with one line, rather than in every worker
        os.environ[_CONFIG_ENV] = str(config_path)
    else:
        os.environ.pop(_CONFIG_ENV, None)
    scheme = "https" if tls else "http"
    mtls = " (client certificates required)" if tls and tls.client_ca else ""
    logger.info(
        "gateway on %s://%s:%d%s (%d worker%s)", scheme, host, port, mtls, workers, "s" if workers > 1 else ""
    )
    # One set of options for uvicorn.run and for the Config of the TLS supervisor below.
    options: dict[str, Any] = {
        "factory": True,
        "host": host,
        "port": port,
        "workers": workers,
        "loop": "uvloop",
        "http": GatewayHttpProtocol,
        "lifespan": "on",
        "access_log": False,
        "server_header": False,
        # The client address is not used (no access log, keys not addresses), so X-Forwarded-* parsing
        # would be per-request work for nothing.
        "proxy_headers": False,
        "timeout_keep_alive": 30,
        # Bounds memory under a connection flood: beyond this uvicorn answers 503 itself.
        "limit_concurrency": 8192,
        "backlog": 4096,
        "log_level": "info",
        # Rebuilt in each worker; reloaded in place on SIGHUP (tls.py).
        "ssl_context_factory": TlsContextFactory(tls) if tls else None,
    }
    if workers > 1 and tls is not None:
        # What uvicorn.run does for several workers, with a supervisor that passes SIGHUP on.
        config = uvicorn.Config(_APP, **options)
        _TlsReloadSupervisor(config, sockets=[config.bind_socket()]).run()
        return
    uvicorn.run(_APP, **options)


_APP = "controlplane.gateway.server:create_app"


class _TlsReloadSupervisor(Multiprocess):
    """uvicorn's supervisor of ``--workers`` processes, passing SIGHUP on to every worker.

    uvicorn itself answers SIGHUP by replacing the workers one by one: a replaced worker closes its idle
    keep-alive connections, and a replacement not ready within uvicorn's health-check timeout (5 s; the
    gateway's start-up takes longer on a busy host) aborts the whole restart, leaving every worker on the
    old certificate. Each worker reloads its TLS context in place on SIGHUP instead (tls.py), as a single
    gateway process does. A worker signalled while it is still starting, before its handler is installed,
    dies of the signal; the supervisor starts it again, and the new one loads the new files.
    """

    def handle_hup(self) -> None:
        logger.info("SIGHUP: reloading the TLS certificate in %d workers", len(self.processes))
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGHUP)
