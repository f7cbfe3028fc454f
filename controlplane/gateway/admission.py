"""Who may call and how much: the API key check, the rate-limit calls and each model's admission queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

from controlplane.errors import StateError
from controlplane.gateway.asgi import Scope
from controlplane.gateway.auth import KeyCache, hash_key
from controlplane.gateway.config import LimitsConfig
from controlplane.gateway.errors import ApiError
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.ratelimit import KeyLimits, RateLimiter, Reservation
from controlplane.gateway.routing import Router
from controlplane.state.base import ApiKeyRecord

logger = logging.getLogger(__name__)

__all__ = ["Admission", "Gate"]


class Gate:
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


class Admission:
    """The admission stage of one gateway: built once at start-up, asked once or twice per request."""

    def __init__(
        self,
        limits: LimitsConfig,
        *,
        keys: KeyCache,
        limiter: RateLimiter,
        router: Router,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._limits = limits
        self._keys = keys
        self.limiter = limiter
        self._router = router
        self._metrics = metrics
        self._clock = clock
        self._store_warned_at = -1e18
        self._gates: dict[str, Gate] = {}

    async def authenticate(self, scope: Scope) -> ApiKeyRecord:
        """The key record of the request's bearer key; refuses oversized heads and unknown keys."""
        auth: bytes | None = None
        total = 0
        for name, value in scope["headers"]:
            total += len(name) + len(value)
            if name == b"authorization":
                auth = value
        if total > self._limits.max_header_bytes:
            raise ApiError(
                431,
                f"request headers are {total} bytes; the limit is {self._limits.max_header_bytes}",
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
            record = await self._keys.get(hash_key(key))
        except StateError as exc:
            # The error names the store (redacted): that is for the log; the client learns only the outage.
            if self._clock() - self._store_warned_at >= 10.0:  # one line per 10 s, not one per request
                self._store_warned_at = self._clock()
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

    async def rate_limit(self, record: ApiKeyRecord, reserve: int) -> Reservation | None:
        """Book ``reserve`` tokens against the key's limits; None for a key without limits."""
        limits = KeyLimits(record.rpm, record.tpm, record.daily_tokens)
        if limits.unlimited:
            return None
        m = self._metrics
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

    def gate(self, model: str) -> Gate:
        """The model's queue, its limit following the model's current replica capacity."""
        lim = self._limits
        limit = max(1, int(self._router.capacity(model) * lim.max_outstanding_per_replica))
        gate = self._gates.get(model)
        if gate is None:
            gate = self._gates[model] = Gate(limit, lim.max_queue_per_model)
        gate.limit = limit  # follows the replica set
        return gate
