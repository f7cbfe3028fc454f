"""Who may call and how much: the API key check, its team and the organisation (the levels), the rate-limit
calls and each model's admission queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import NoReturn

from controlplane.errors import StateError
from controlplane.gateway.asgi import Scope
from controlplane.gateway.auth import KeyCache, TeamCache, hash_key
from controlplane.gateway.config import LimitsConfig, OrganisationLimits
from controlplane.gateway.errors import ApiError
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.ratelimit import Admitted, KeyLimits, Level, RateLimiter, admit_levels
from controlplane.gateway.routing import Router
from controlplane.state.base import ApiKeyRecord, TeamRecord

logger = logging.getLogger(__name__)

__all__ = ["Admission", "Gate", "ratelimit_headers"]

_LIMIT_WORDS = {
    "rpm": "requests per minute",
    "tpm": "tokens per minute",
    "daily": "tokens per UTC day",
    "monthly": "tokens per UTC month",
}


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
        teams: TeamCache,
        organisation: OrganisationLimits,
        limiter: RateLimiter,
        router: Router,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._limits = limits
        self._keys = keys
        self._teams = teams
        org = organisation
        org_limits = KeyLimits(org.rpm, org.tpm, org.daily_tokens, org.monthly_tokens)
        self._org: tuple[Level, ...] = ()
        if org.models or org.max_prompt_tokens is not None or not org_limits.unlimited:
            self._org = (
                Level("organisation", "", "org", org_limits, tuple(org.models), org.max_prompt_tokens),
            )
        self.limiter = limiter
        self._router = router
        self._metrics = metrics
        self._clock = clock
        self._store_warned_at = -1e18
        self._levels: dict[str, tuple[ApiKeyRecord, TeamRecord | None, tuple[Level, ...]]] = {}
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
            self._store_unavailable(exc)
        now = self._clock()
        if record is None or record.revoked or (record.expires_at is not None and record.expires_at <= now):
            raise ApiError(
                401, "invalid, revoked or expired API key", code="invalid_api_key", reason="bad_key"
            )
        return record

    async def levels(self, record: ApiKeyRecord) -> tuple[Level, ...]:
        """The levels a key's requests are admitted by: the key, its team (if any) and the organisation."""
        team: TeamRecord | None = None
        if record.team:
            try:
                team = await self._teams.get(record.team)
            except StateError as exc:
                self._store_unavailable(exc)
        # Built once per key and team record (the caches hand out the same objects until they expire).
        hit = self._levels.get(record.key_hash)
        if hit is not None and hit[0] is record and hit[1] is team:
            return hit[2]
        levels = self._build_levels(record, team)
        if len(self._levels) >= 10_000:
            self._levels.clear()
        self._levels[record.key_hash] = (record, team, levels)
        return levels

    def _build_levels(self, record: ApiKeyRecord, team: TeamRecord | None) -> tuple[Level, ...]:
        key = Level(
            "key",
            record.name,
            # The hash prefix, not the name: names may hold characters that clash with Redis hash tags.
            record.key_hash[:24],
            KeyLimits(record.rpm, record.tpm, record.daily_tokens),
            tuple(record.models),
            record.max_prompt_tokens,
        )
        if team is None:  # no team, or one deleted while a key still names it: nothing at that level
            return (key, *self._org)
        return (key, _team_level(team), *self._org)

    def _store_unavailable(self, exc: StateError) -> NoReturn:
        # The error names the store (redacted): that is for the log; the client learns only the outage.
        if self._clock() - self._store_warned_at >= 10.0:  # one line per 10 s, not one per request
            self._store_warned_at = self._clock()
            logger.warning("cannot check API keys: %s", exc)
        raise ApiError(
            503, "cannot check the API key: the key store is unavailable", code="state_unavailable"
        ) from None

    async def rate_limit(self, levels: tuple[Level, ...], team: str, reserve: int) -> Admitted:
        """Book ``reserve`` tokens against every level's limits; refuse naming the level and the limit."""
        m = self._metrics
        result = await admit_levels(self.limiter, levels, reserve, self._clock())
        if isinstance(result, Admitted):
            if result.unchecked:
                m.limiter_errors.labels("admitted").inc()
            return result
        level, decision = result.level, result.decision
        if decision.backend_error:
            m.limiter_errors.labels("refused").inc()
            raise ApiError(
                503, "the rate limiter is unavailable", code="ratelimit_unavailable", retry_after=1
            )
        limit = decision.reason or "unknown"
        reason = limit if level.kind == "key" else f"{level.kind}_{limit}"
        m.ratelimit_rejections.labels(levels[0].name, team, reason).inc()
        value = {
            "rpm": level.limits.rpm,
            "tpm": level.limits.tpm,
            "daily": level.limits.daily_tokens,
            "monthly": level.limits.monthly_tokens,
        }.get(limit)
        what = f"{value} {_LIMIT_WORDS[limit]}" if value is not None else limit
        headers: list[tuple[bytes, bytes]] = [(b"x-sarv-ratelimit-level", level.kind.encode())]
        if limit == "rpm" and value is not None:
            headers += _headers("requests", value, 0, decision.retry_after)
        elif limit == "tpm" and value is not None:
            headers += _headers("tokens", value, 0, decision.retry_after)
        raise ApiError(
            429,
            f"rate limit exceeded: {level.label} is limited to {what}; "
            f"retry after {decision.retry_after:.0f}s",
            code="rate_limit_exceeded",
            retry_after=decision.retry_after,
            reason="ratelimit",
            headers=headers,
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


def _team_level(team: TeamRecord) -> Level:
    return Level(
        "team",
        team.name,
        # Team names are letters, digits and . _ - (TeamRecord): safe inside a Cluster hash tag.
        f"team:{team.name}",
        KeyLimits(team.rpm, team.tpm, team.daily_tokens, team.monthly_tokens),
        tuple(team.models),
        team.max_prompt_tokens,
    )


def _reset(seconds: float) -> bytes:
    """A duration as OpenAI writes it in ``x-ratelimit-reset-*``: ``20ms``, ``1.5s``, ``6m0s``."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms".encode()
    minutes, secs = divmod(ms / 1000, 60)
    return (f"{int(minutes)}m{secs:.0f}s" if minutes else f"{secs:.3g}s").encode()


def _headers(kind: str, limit: int, remaining: int, reset: float) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-ratelimit-limit-" + kind.encode(), str(limit).encode()),
        (b"x-ratelimit-remaining-" + kind.encode(), str(max(0, remaining)).encode()),
        (b"x-ratelimit-reset-" + kind.encode(), _reset(reset)),
    ]


def ratelimit_headers(admitted: Admitted) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-*`` headers for the level with the fewest requests (and tokens) left.

    The reset is the time the sliding window takes to drain what is used: ``used ÷ limit × 60 s``.
    """
    out: list[tuple[bytes, bytes]] = []
    if admitted.requests is not None:
        limit, left = admitted.requests
        out += _headers("requests", limit, left, (limit - left) / limit * 60.0)
    if admitted.tokens is not None:
        limit, left = admitted.tokens
        out += _headers("tokens", limit, left, (limit - left) / limit * 60.0)
    return out
