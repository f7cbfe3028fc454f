"""API keys: generation, hashing, and short-TTL caches of the store's key and team records."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from controlplane.state.base import ApiKeyRecord, StateStore, TeamRecord

__all__ = ["KEY_PREFIX", "KeyCache", "RecordCache", "TeamCache", "hash_key", "new_key"]

_R = TypeVar("_R")

KEY_PREFIX = "sk-sarv-"


def new_key() -> str:
    """A fresh secret: ``sk-sarv-`` + 43 url-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class RecordCache(Generic[_R]):
    """id → record (or None for unknown ids) for ``ttl`` seconds; bounded, oldest entries dropped first.

    Unknown ids are cached too, so that a client cycling random keys costs one store read per key and
    TTL, not one per request. A change in the store takes effect within ``ttl``.
    """

    def __init__(
        self,
        load: Callable[[str], _R | None],
        *,
        ttl: float,
        size: int,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._load = load
        self._ttl = ttl
        self._size = size
        self._now = monotonic
        self._entries: dict[str, tuple[_R | None, float]] = {}

    async def get(self, ident: str) -> _R | None:
        """The record; raises :class:`~controlplane.errors.StateError` when the store fails."""
        now = self._now()
        hit = self._entries.get(ident)
        if hit is not None and hit[1] > now:
            return hit[0]
        record = await asyncio.to_thread(self._load, ident)
        if len(self._entries) >= self._size:
            # dicts keep insertion order: drop the oldest tenth in one go rather than one per miss
            for k in list(self._entries)[: max(1, self._size // 10)]:
                del self._entries[k]
        self._entries[ident] = (record, now + self._ttl)
        return record


class KeyCache(RecordCache[ApiKeyRecord]):
    """key hash → :class:`ApiKeyRecord`; a revoked key stops working within ``ttl``."""

    def __init__(
        self, store: StateStore, *, ttl: float, size: int, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(store.get_api_key, ttl=ttl, size=size, monotonic=monotonic)


class TeamCache(RecordCache[TeamRecord]):
    """team name → :class:`TeamRecord`; a team's changed limits apply within ``ttl``."""

    def __init__(
        self, store: StateStore, *, ttl: float, size: int, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(store.get_team, ttl=ttl, size=size, monotonic=monotonic)
