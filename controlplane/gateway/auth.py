"""API keys: generation, hashing, and a short-TTL cache of the store's key records."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Callable

from controlplane.state.base import ApiKeyRecord, StateStore

__all__ = ["KEY_PREFIX", "KeyCache", "hash_key", "new_key"]

KEY_PREFIX = "sk-sarv-"


def new_key() -> str:
    """A fresh secret: ``sk-sarv-`` + 43 url-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class KeyCache:
    """hash → record (or None for unknown keys) for ``ttl`` seconds; bounded, oldest entries dropped first.

    Unknown keys are cached too, so that a client cycling random keys costs one store read per key and
    TTL, not one per request. A revoked key stops working within ``ttl``.
    """

    def __init__(
        self, store: StateStore, *, ttl: float, size: int, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._store = store
        self._ttl = ttl
        self._size = size
        self._now = monotonic
        self._entries: dict[str, tuple[ApiKeyRecord | None, float]] = {}

    async def get(self, key_hash: str) -> ApiKeyRecord | None:
        """The key's record; raises :class:`~controlplane.errors.StateError` when the store fails."""
        now = self._now()
        hit = self._entries.get(key_hash)
        if hit is not None and hit[1] > now:
            return hit[0]
        record = await asyncio.to_thread(self._store.get_api_key, key_hash)
        if len(self._entries) >= self._size:
            # dicts keep insertion order: drop the oldest tenth in one go rather than one per miss
            for k in list(self._entries)[: max(1, self._size // 10)]:
                del self._entries[k]
        self._entries[key_hash] = (record, now + self._ttl)
        return record
