"""Every Redis client Sarv opens, built in one place from a state URL and settings.

The state store and the controller lease use :func:`sync_client`; the gateway's rate limiter uses
:func:`async_client`. Both read the same :class:`RedisEndpoint`, so standalone and Cluster, TLS (CA,
client certificate and key), ACL user and password mean the same thing on every path:

- ``redis://[USER[:PASSWORD]@]HOST[:PORT][/DB]`` and ``rediss://…`` (TLS) — one server;
- ``redis+cluster://[USER[:PASSWORD]@]HOST:PORT,HOST:PORT,…`` and ``rediss+cluster://…`` — a Cluster,
  the hosts being its start-up nodes.

Credentials in the URL win over ``redis_username``/``redis_password`` from settings; the TLS files come from
``redis_tls_ca``, ``redis_tls_cert`` and ``redis_tls_key``. A TLS server's certificate is always verified.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controlplane.errors import ConfigError, StateError
from controlplane.state.url import RedisTarget, parse_state_url, redact_url

if TYPE_CHECKING:
    from pathlib import Path

    import redis
    import redis.asyncio
    import redis.cluster

    from controlplane.settings import Settings

__all__ = [
    "RedisEndpoint",
    "async_client",
    "is_redis_url",
    "redis_endpoint",
    "redis_error",
    "sync_client",
]


@dataclass(frozen=True)
class RedisEndpoint:
    """A Redis state URL resolved against settings: the servers, who connects, and the TLS files.

    ``shown`` is the URL with its password replaced by ``***``, for messages and logs; ``repr`` leaves
    the target (and so the password) out.
    """

    target: RedisTarget = field(repr=False)
    shown: str
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def scrub(self, text: str) -> str:
        """``text`` with the password, wherever it appears, replaced by ``***``."""
        secret = self.target.password
        return text.replace(secret, "***") if secret else text


def is_redis_url(url: str) -> bool:
    """Whether ``url`` names Redis (any of the four schemes); a malformed URL raises :class:`ConfigError`."""
    return isinstance(parse_state_url(url), RedisTarget)


def redis_endpoint(url: str, settings: Settings | None = None) -> RedisEndpoint:
    """Parse ``url`` and resolve it against ``settings``; nothing touches the network.

    Raises :class:`ConfigError` when ``url`` is malformed or not a Redis URL, or a TLS file is missing.
    """
    shown = redact_url(url)
    target = parse_state_url(url)
    if not isinstance(target, RedisTarget):
        raise ConfigError(f"state URL {shown} is not a Redis URL")
    if settings is not None:
        target = RedisTarget(
            nodes=target.nodes,
            db=target.db,
            tls=target.tls,
            cluster=target.cluster,
            username=target.username or settings.redis_username,
            password=target.password if target.password is not None else settings.redis_password,
        )
    files = (
        (settings.redis_tls_ca, settings.redis_tls_cert, settings.redis_tls_key) if settings else (None,) * 3
    )
    for name, path in zip(("redis_tls_ca", "redis_tls_cert", "redis_tls_key"), files, strict=True):
        if path is not None and not path.is_file():
            raise ConfigError(f"{name} {path} does not exist or is not a file")
    return RedisEndpoint(target, shown, *files)


def redis_error(endpoint: RedisEndpoint, exc: BaseException, *, what: str = "state store") -> StateError:
    """``exc`` (a redis-py or socket error) as a one-line :class:`StateError` naming the redacted URL."""
    text = endpoint.scrub(str(exc) or type(exc).__name__)
    return StateError(f"{what} {endpoint.shown}: {text}", hint=_hint(exc))


def _hint(exc: BaseException) -> str | None:
    name = type(exc).__name__
    if "Authentication" in name or "NOPERM" in str(exc) or "WRONGPASS" in str(exc):
        return "check redis_username / redis_password (or the URL's user:password) and the ACL"
    if "certificate" in str(exc).lower() or "SSL" in name:
        return "check redis_tls_ca (the CA that signed the server's certificate) and the host name"
    if "Connection" in name or "Timeout" in name or isinstance(exc, OSError):
        return "is the server running and reachable from this host?"
    return None


def _options(endpoint: RedisEndpoint, timeout_s: float) -> dict[str, Any]:
    """Keyword arguments every client and connection class of redis-py accepts."""
    t = endpoint.target
    options: dict[str, Any] = {
        "username": t.username,
        "password": t.password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
    }
    if t.tls:
        options.update(
            ssl_cert_reqs="required",
            ssl_ca_certs=_text(endpoint.tls_ca),
            ssl_certfile=_text(endpoint.tls_cert),
            ssl_keyfile=_text(endpoint.tls_key),
        )
    return options


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


def sync_client(
    endpoint: RedisEndpoint, *, timeout_s: float = 5.0, decode_responses: bool = True
) -> redis.Redis | redis.cluster.RedisCluster:
    """A blocking client: ``redis.Redis`` for one server, ``RedisCluster`` for a Cluster.

    A standalone client connects on first use. A Cluster client reads the slot map from a start-up node
    here, so this can fail: as :class:`StateError` naming the redacted URL.
    """
    import redis
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import RedisClusterException, RedisError

    t = endpoint.target
    options = _options(endpoint, timeout_s)
    options.update(decode_responses=decode_responses, ssl=t.tls)
    if not t.cluster:
        host, port = t.nodes[0]
        return redis.Redis(host=host, port=port, db=t.db, **options)
    # The sync ClusterNode's constructor has no annotations; through a typed callable mypy checks the call.
    node: Callable[[str, int], ClusterNode] = ClusterNode
    try:
        return RedisCluster(startup_nodes=[node(host, port) for host, port in t.nodes], **options)
    except (RedisError, RedisClusterException, OSError) as exc:
        raise redis_error(endpoint, exc) from None


def async_client(
    endpoint: RedisEndpoint,
    *,
    timeout_s: float = 0.5,
    max_connections: int = 64,
    pool_timeout_s: float = 1.0,
) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
    """An asyncio client returning bytes; nothing connects until the first command.

    One server: a pool of at most ``max_connections`` that waits up to ``pool_timeout_s`` for a free
    connection, so a burst never opens thousands of sockets. A Cluster: at most ``max_connections`` per
    node (redis-py's Cluster client has no waiting pool; a command beyond that fails at once).
    """
    from redis.asyncio import BlockingConnectionPool, Connection, Redis, RedisCluster, SSLConnection
    from redis.asyncio.cluster import ClusterNode

    t = endpoint.target
    options = _options(endpoint, timeout_s)
    if t.cluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in t.nodes],
            max_connections=max_connections,
            ssl=t.tls,
            **options,
        )
    host, port = t.nodes[0]
    pool = BlockingConnectionPool(
        connection_class=SSLConnection if t.tls else Connection,
        max_connections=max_connections,
        timeout=pool_timeout_s,
        host=host,
        port=port,
        db=t.db,
        **options,
    )
    # The client owns the pool, so aclose() disconnects it too.
    return Redis.from_pool(pool)
