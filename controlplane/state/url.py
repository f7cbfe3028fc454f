"""State URLs (``sqlite:///``, ``redis[s]://``, ``redis[s]+cluster://``) split into checked parts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from controlplane.errors import ConfigError

__all__ = ["RedisTarget", "SqliteTarget", "parse_state_url", "redact_url"]

_SCHEMES = (
    "use sqlite:///PATH, redis://HOST:PORT/DB, rediss://HOST:PORT/DB, redis+cluster://HOST:PORT,HOST:PORT "
    "or rediss+cluster://HOST:PORT,HOST:PORT"
)


@dataclass(frozen=True)
class SqliteTarget:
    path: Path


@dataclass(frozen=True)
class RedisTarget:
    nodes: tuple[tuple[str, int], ...]
    db: int
    tls: bool
    cluster: bool
    username: str | None
    password: str | None


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if colon else ''}@{hosts}{slash}{tail}"


def _host_port(item: str, shown: str) -> tuple[str, int]:
    host, colon, port_text = item.rpartition(":")
    if not colon:
        host, port_text = item, "6379"
    host = host.removeprefix("[").removesuffix("]")
    if not host:
        raise ConfigError(f"state URL {shown}: missing host in {item!r}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ConfigError(f"state URL {shown}: port {port_text!r} must be a number from 1 to 65535")
    return host, int(port_text)


def parse_state_url(url: str) -> SqliteTarget | RedisTarget:
    """Check ``url`` and split it; :class:`ConfigError` says what is wrong and which forms work."""
    shown = redact_url(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigError(f"state URL {shown!r} has no scheme; {_SCHEMES}")
    scheme = scheme.lower()
    if scheme == "sqlite":
        if not rest.startswith("/") or rest == "/":
            raise ConfigError(
                f"state URL {shown}: expected sqlite:///PATH (three slashes, then the file path)"
            )
        path = rest[1:]
        if path in {":memory:", ""} or "?" in path:
            raise ConfigError(
                f"state URL {shown}: give a file path (in-memory and URI options are not supported)"
            )
        return SqliteTarget(path=Path(path).expanduser())
    if scheme not in {"redis", "rediss", "redis+cluster", "rediss+cluster"}:
        raise ConfigError(f"state URL {shown}: unsupported scheme {scheme!r}; {_SCHEMES}")
    if "?" in rest or "#" in rest:
        raise ConfigError(
            f"state URL {shown}: query options are not supported; set TLS files and credentials in settings "
            "(redis_tls_ca, redis_username, redis_password)"
        )
    cluster = scheme.endswith("+cluster")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    if not hosts:
        raise ConfigError(f"state URL {shown}: missing host")
    items = hosts.split(",")
    if len(items) > 1 and not cluster:
        raise ConfigError(f"state URL {shown}: several hosts need the redis+cluster:// scheme")
    nodes = tuple(_host_port(item, shown) for item in items)
    db_text = path.strip("/") or "0"
    if not db_text.isdigit():
        raise ConfigError(f"state URL {shown}: database {db_text!r} must be a number (e.g. /0)")
    if cluster and db_text != "0":
        raise ConfigError(f"state URL {shown}: Redis Cluster has only database 0")
    return RedisTarget(
        nodes=nodes,
        db=int(db_text),
        tls=scheme.startswith("rediss"),
        cluster=cluster,
        username=username,
        password=password,
    )
