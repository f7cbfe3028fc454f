"""Builds the gateway from settings (store, limiter) and serves it with uvicorn's production settings."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from controlplane.errors import ConfigError
from controlplane.gateway.app import GatewayApp
from controlplane.gateway.config import load_gateway_config
from controlplane.gateway.ratelimit import InProcessLimiter, RateLimiter, RedisLimiter
from controlplane.settings import Settings, load_settings

__all__ = ["build_app", "create_app", "serve"]

logger = logging.getLogger(__name__)

# The config file path travels to uvicorn's worker processes in the environment.
_CONFIG_ENV = "SARV_GATEWAY_CONFIG"


def _limiter(settings: Settings) -> RateLimiter:
    url = settings.resolved_state_url
    if url.startswith(("redis://", "rediss://")):
        from redis.asyncio import BlockingConnectionPool, Redis

        # A bounded pool that waits for a free connection: a burst must not open thousands of sockets.
        pool: BlockingConnectionPool[Any] = BlockingConnectionPool.from_url(
            url,
            max_connections=64,
            timeout=1.0,
            username=settings.redis_username,
            password=settings.redis_password,
            socket_timeout=0.5,
            socket_connect_timeout=0.5,
        )
        # The client owns the pool, so aclose() disconnects it (types-redis predates from_pool).
        client = Redis.from_pool(pool)  # type: ignore[attr-defined]
        return RedisLimiter(
            client,
            prefix=settings.state_prefix,
            fail_open=settings.ratelimit_fail_open,
            lease_fraction=settings.ratelimit_lease_fraction,
        )
    if url.startswith("redis+cluster://"):
        from redis.asyncio import RedisCluster

        first = url.removeprefix("redis+cluster://").split(",")[0]
        host, _, port = first.rpartition(":")
        cluster: RedisCluster[bytes] = RedisCluster(
            host=host,
            port=int(port),
            username=settings.redis_username,
            password=settings.redis_password,
            socket_timeout=0.5,
            socket_connect_timeout=0.5,
        )
        return RedisLimiter(
            cluster,
            prefix=settings.state_prefix,
            fail_open=settings.ratelimit_fail_open,
            lease_fraction=settings.ratelimit_lease_fraction,
        )
    # SQLite (embedded default): one gateway process, so an in-process limiter has the same semantics.
    return InProcessLimiter()


def build_app(settings: Settings, config_path: Path | None = None, *, tune_gc: bool = False) -> GatewayApp:
    """The app for these settings; nothing connects until the ASGI lifespan starts it."""
    from controlplane.state import open_store

    config = load_gateway_config(config_path)
    store = open_store(settings.resolved_state_url, settings)
    return GatewayApp(store=store, config=config, limiter=_limiter(settings), tune_gc=tune_gc)


def create_app() -> GatewayApp:
    """uvicorn factory (``--workers`` > 1 imports this in every worker)."""
    path = os.environ.get(_CONFIG_ENV)
    return build_app(load_settings(), Path(path) if path else None, tune_gc=True)


def serve(settings: Settings, *, host: str, port: int, workers: int, config_path: Path | None) -> None:
    """Run uvicorn (uvloop + httptools, no access log) until interrupted."""
    import uvicorn

    if workers > 1 and not settings.resolved_state_url.startswith(
        ("redis://", "rediss://", "redis+cluster://")
    ):
        raise ConfigError(
            f"--workers {workers} needs Redis state (rate limits are shared only through Redis)",
            hint="set SARV_STATE_URL=redis://… or run one worker",
        )
    if config_path is not None:
        load_gateway_config(config_path)  # fail here, with one line, rather than in every worker
        os.environ[_CONFIG_ENV] = str(config_path)
    else:
        os.environ.pop(_CONFIG_ENV, None)
    logger.info("gateway on http://%s:%d (%d worker%s)", host, port, workers, "s" if workers > 1 else "")
    uvicorn.run(
        "controlplane.gateway.server:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        server_header=False,
        # The client address is not used (no access log, keys not addresses), so X-Forwarded-* parsing
        # would be per-request work for nothing.
        proxy_headers=False,
        timeout_keep_alive=30,
        # Bounds memory under a connection flood: beyond this uvicorn answers 503 itself.
        limit_concurrency=8192,
        backlog=4096,
        log_level="info",
    )
