"""One active controller: a Redis lease (SET NX PX, renewed by compare-and-set), or a lock file for SQLite."""

from __future__ import annotations

import fcntl
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from controlplane.errors import ConfigError, StateError
from controlplane.state.clients import redis_endpoint, sync_client
from controlplane.state.url import RedisTarget, parse_state_url

if TYPE_CHECKING:
    from controlplane.settings import Settings

__all__ = ["FileLease", "Lease", "RedisLease", "holder_id", "open_lease"]

# KEYS[1] lease; ARGV[1] holder, ARGV[2] ttl ms. Renew when we hold it, take it when nobody does.
# One script, so that "is it mine?" and "extend it" cannot be split by another controller's SET.
_ACQUIRE = """
local owner = redis.call('GET', KEYS[1])
if owner == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not owner then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# KEYS[1] lease; ARGV[1] holder. Delete only our own lease, never a successor's.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@runtime_checkable
class Lease(Protocol):
    """Who may act. ``acquire`` is called every period: it takes, renews or fails to hold the lease."""

    @property
    def holder(self) -> str: ...

    def acquire(self) -> bool:
        """True when this controller holds the lease now (taken or renewed)."""
        ...

    def held(self) -> bool:
        """True while the lease from the last successful ``acquire`` cannot have expired yet."""
        ...

    def owner(self) -> str | None:
        """Who holds the lease, as far as the backend says (None: nobody, or unknown)."""
        ...

    def release(self) -> None: ...


def holder_id() -> str:
    """``host:pid:random``: unique per process, and readable in ``redis-cli GET`` when debugging."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class RedisLease:
    """A lease key with a TTL: taken with SET NX PX, renewed only by its holder (Lua compare-and-set).

    The holder trusts its lease for ``ttl × safety`` after each renewal, measured on its own monotonic
    clock from *before* the request was sent, so a slow round trip shortens the trusted window instead
    of stretching it past the key's expiry in Redis.
    """

    def __init__(
        self,
        client: Any,
        key: str,
        *,
        ttl_s: float,
        holder: str | None = None,
        safety: float = 0.8,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ConfigError(f"lease TTL must be positive, got {ttl_s}")
        self._client = client
        self._key = key
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._trust_s = ttl_s * safety
        self._holder = holder or holder_id()
        self._monotonic = monotonic
        self._valid_until: float | None = None
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)

    @property
    def holder(self) -> str:
        return self._holder

    def _run(self, fn: Callable[[], Any]) -> Any:
        from redis.exceptions import RedisClusterException, RedisError

        try:
            return fn()
        except (RedisError, RedisClusterException, OSError) as exc:
            raise StateError(f"controller lease {self._key}: {exc}") from None

    def acquire(self) -> bool:
        started = self._monotonic()
        try:
            got = self._run(lambda: self._acquire(keys=[self._key], args=[self._holder, self._ttl_ms]))
        except StateError:
            self._valid_until = None
            raise
        held = int(got) == 1
        self._valid_until = started + self._trust_s if held else None
        return held

    def held(self) -> bool:
        return self._valid_until is not None and self._monotonic() < self._valid_until

    def owner(self) -> str | None:
        value = self._run(lambda: self._client.get(self._key))
        if isinstance(value, bytes):
            return value.decode()
        return None if value is None else str(value)

    def release(self) -> None:
        self._valid_until = None
        self._run(lambda: self._release(keys=[self._key], args=[self._holder]))


class FileLease:
    """An exclusive ``flock`` on a file next to the SQLite database: one controller per host and file.

    The kernel drops the lock when the process dies, so a crashed controller never blocks the next.
    """

    def __init__(self, path: Path, *, holder: str | None = None) -> None:
        self._path = path
        self._holder = holder or holder_id()
        self._fd: int | None = None

    @property
    def holder(self) -> str:
        return self._holder

    def acquire(self) -> bool:
        if self._fd is not None:
            return True
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StateError(f"controller lock {self._path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        # Record who holds it, for `cat` when debugging; the lock, not the text, is what counts.
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._holder.encode() + b"\n", 0)
        self._fd = fd
        return True

    def held(self) -> bool:
        return self._fd is not None

    def owner(self) -> str | None:
        try:
            text = self._path.read_text(encoding="utf-8").strip()
        except OSError:
            return None
        return text or None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def open_lease(
    state_url: str, settings: Settings | None = None, *, ttl_s: float, holder: str | None = None
) -> tuple[Lease, Callable[[], None]]:
    """The lease matching the state backend, and a function closing its connection.

    Redis: the key ``{<state_prefix>}controller-lease`` (the store's hash tag, so it lives in the same
    Cluster slot). SQLite: ``<database>.controller.lock`` next to the database file.
    """
    target = parse_state_url(state_url)
    if not isinstance(target, RedisTarget):
        lease = FileLease(target.path.with_name(target.path.name + ".controller.lock"), holder=holder)
        return lease, lease.release
    prefix = settings.state_prefix if settings else "sarv:"
    if ttl_s <= 0:
        raise ConfigError(f"lease TTL must be positive, got {ttl_s}")
    # A standalone client connects on the first acquire; a Cluster client reads the slot map here.
    client = sync_client(redis_endpoint(state_url, settings))
    redis_lease = RedisLease(client, "{" + prefix + "}controller-lease", ttl_s=ttl_s, holder=holder)
    return redis_lease, client.close
