"""The admin listener: ``/metrics`` on its own address and port, apart from the public API.

The API port faces every client; the metrics list every API key's name and each model's traffic. So they
are served here, by default on loopback (``gateway_metrics_host``/``gateway_metrics_port``), and, with
``gateway_metrics_token_file``, only to a caller presenting that bearer token (Prometheus's
``authorization.credentials_file``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from controlplane.errors import ConfigError
from controlplane.gateway.asgi import Receive, Scope, Send, respond, respond_error
from controlplane.gateway.errors import ApiError
from controlplane.gateway.metrics import GatewayMetrics

__all__ = ["AdminApp", "AdminListener", "read_token"]

logger = logging.getLogger(__name__)

_PROMETHEUS_TEXT = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]


def read_token(path: Path | None) -> str | None:
    """The bearer token in ``path`` (its first line), or None; a one-line error when it is unusable."""
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the metrics token file {path}: {exc.strerror or exc}") from None
    if len(token) < 16:
        raise ConfigError(
            f"the metrics token in {path} is {len(token)} characters; use at least 16",
            hint="e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE",
        )
    return token


class AdminApp:
    """ASGI app of the admin listener: ``GET /metrics``, behind the bearer token when one is set."""

    def __init__(self, metrics: GatewayMetrics, token: str | None = None) -> None:
        self._metrics = metrics
        self._expected = None if token is None else b"Bearer " + token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if path != "/metrics":
            await respond_error(send, ApiError(404, f"no route {scope['method']} {path}", code="not_found"))
            return
        if scope["method"] not in ("GET", "HEAD"):
            await respond_error(send, ApiError(405, "/metrics accepts GET only", code="method_not_allowed"))
            return
        if self._expected is not None:
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(auth, self._expected):
                await respond_error(
                    send,
                    ApiError(401, "missing or wrong metrics token", code="invalid_api_key"),
                    [(b"www-authenticate", b"Bearer")],
                )
                return
        await respond(send, 200, self._metrics.render(), _PROMETHEUS_TEXT)


@dataclass
class AdminListener:
    """Where the admin app listens. ``reuse_port``: one per worker process on the same port (each then
    answers with its own worker's series, as the API port did)."""

    host: str = "127.0.0.1"
    port: int = 9107
    token: str | None = None
    reuse_port: bool = False

    def __post_init__(self) -> None:
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Protocol] = set()

    @property
    def address(self) -> tuple[str, int]:
        """The bound address (the real port when ``port`` was 0); valid once started."""
        if self._server is None or not self._server.sockets:
            return self.host, self.port
        name = self._server.sockets[0].getsockname()
        return str(name[0]), int(name[1])

    async def start(self, metrics: GatewayMetrics) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise ConfigError(
                f"cannot listen for metrics on {self.host}:{self.port}: {exc.strerror or exc}",
                hint="set gateway_metrics_host/gateway_metrics_port (--metrics-host/--metrics-port) "
                "to a free address, or --metrics-port 0 for none",
            ) from None
        sock.listen(64)
        sock.setblocking(False)
        config = uvicorn.Config(
            AdminApp(metrics, self.token),
            http="h11",
            lifespan="off",
            access_log=False,
            server_header=False,
            date_header=False,
            log_level="warning",
            timeout_keep_alive=30,
        )
        config.load()
        server = uvicorn.Server(config)

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=server.server_state, app_state={}
            )

        self._connections = server.server_state.connections  # type: ignore[assignment]
        self._server = await asyncio.get_running_loop().create_server(protocol, sock=sock)
        host, port = self.address
        logger.info("metrics on http://%s:%d/metrics%s", host, port, " (bearer token)" if self.token else "")

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self._connections):
                conn.shutdown()  # type: ignore[attr-defined]  # keep-alive scrapers: close them too
            await self._server.wait_closed()
            self._server = None
