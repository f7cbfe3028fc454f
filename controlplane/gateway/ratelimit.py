"""Per-key request and token limits: a sliding-window counter, atomic in Redis (Lua) or in one process."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

# The window is the "sliding window counter" of two fixed one-minute buckets: the estimate is
# ``previous × (1 − elapsed/60) + current``. It needs two integers per key and limit (no per-request
# entries) and is exact at the window boundary, pessimistic between. Tokens are reserved at admission
# (prompt + ``max_tokens`` or a default) and settled with the real usage at completion, into the bucket the
# reservation was booked in. The daily quota is a UTC-day counter.

__all__ = [
    "Decision",
    "InProcessLimiter",
    "KeyLimits",
    "RateLimiter",
    "RedisLimiter",
    "Reservation",
]

logger = logging.getLogger(__name__)

_WINDOW = 60.0
_DAY = 86400.0


@dataclass(frozen=True, slots=True)
class KeyLimits:
    rpm: int | None = None
    tpm: int | None = None
    daily_tokens: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None and self.daily_tokens is None


@dataclass(frozen=True, slots=True)
class Reservation:
    key: str
    tokens: int
    window: int
    day: int


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str | None = None
    """``rpm``, ``tpm``, ``daily`` or ``limiter_unavailable``."""
    retry_after: float = 0.0
    reservation: Reservation | None = None
    backend_error: bool = False


class RateLimiter(Protocol):
    """Admission and settlement; implementations are safe under concurrent calls from one event loop."""

    async def admit(self, key: str, limits: KeyLimits, tokens: int, now: float) -> Decision: ...
    async def settle(self, reservation: Reservation, actual_tokens: int) -> None: ...
    async def close(self) -> None: ...


def _wait(prev: float, cur: float, need: float, limit: float, elapsed: float) -> float:
    """Seconds until ``prev × (1 − t/60) + cur + need ≤ limit`` can hold (same formula as the Lua script)."""
    if cur + need <= limit:
        if prev <= 0:
            return 1.0
        frac = 1.0 - (limit - cur - need) / prev
        return max(1.0, frac * _WINDOW - elapsed)
    # Not before the next window, where the current bucket becomes the previous one.
    frac = 0.0 if cur <= 0 else max(0.0, 1.0 - (limit - need) / cur)
    return max(1.0, _WINDOW - elapsed + frac * _WINDOW)


class InProcessLimiter:
    """The limiter for a single gateway process (embedded SQLite default): same semantics, no Redis."""

    def __init__(self) -> None:
        # key -> {(kind, window): count}; only the current and previous windows are kept per key.
        self._counts: dict[str, dict[tuple[str, int], float]] = {}

    def _get(self, key: str, kind: str, window: int) -> float:
        return self._counts.get(key, {}).get((kind, window), 0.0)

    async def admit(self, key: str, limits: KeyLimits, tokens: int, now: float) -> Decision:
        window = int(now // _WINDOW)
        day = int(now // _DAY)
        elapsed = now - window * _WINDOW
        frac = elapsed / _WINDOW
        if limits.tpm is not None:
            tokens = min(tokens, limits.tpm)
        checks = (("r", limits.rpm, 1), ("t", limits.tpm, tokens))
        for kind, limit, need in checks:
            if limit is None:
                continue
            prev, cur = self._get(key, kind, window - 1), self._get(key, kind, window)
            if prev * (1 - frac) + cur + need > limit:
                reason = "rpm" if kind == "r" else "tpm"
                return Decision(False, reason, _wait(prev, cur, need, limit, elapsed))
        if limits.daily_tokens is not None and self._get(key, "d", day) + tokens > limits.daily_tokens:
            return Decision(False, "daily", max(1.0, (day + 1) * _DAY - now))
        counts = self._counts.setdefault(key, {})
        for stale in [
            k for k in counts if (k[0] != "d" and k[1] < window - 1) or (k[0] == "d" and k[1] < day)
        ]:
            del counts[stale]
        counts[("r", window)] = counts.get(("r", window), 0.0) + 1
        counts[("t", window)] = counts.get(("t", window), 0.0) + tokens
        counts[("d", day)] = counts.get(("d", day), 0.0) + tokens
        return Decision(True, reservation=Reservation(key, tokens, window, day))

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        delta = actual_tokens - reservation.tokens
        if delta == 0:
            return
        counts = self._counts.setdefault(reservation.key, {})
        for slot in (("t", reservation.window), ("d", reservation.day)):
            if slot in counts:
                counts[slot] = max(0.0, counts[slot] + delta)

    async def close(self) -> None:
        self._counts.clear()


# KEYS: requests(prev, cur), tokens(prev, cur), day.  ARGV: elapsed, rpm, tpm, daily, tokens (0 = none).
# Returns {"ok"} or {reason, seconds-as-string} (Redis truncates Lua numbers to integers).
_ADMIT_LUA = """
local elapsed = tonumber(ARGV[1])
local rpm = tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
local daily = tonumber(ARGV[4])
local tokens = tonumber(ARGV[5])
local frac = elapsed / 60
local function wait(prev, cur, need, limit)
  if cur + need <= limit then
    if prev <= 0 then return 1 end
    local f = 1 - (limit - cur - need) / prev
    return math.max(1, f * 60 - elapsed)
  end
  local f = 0
  if cur > 0 then f = math.max(0, 1 - (limit - need) / cur) end
  return math.max(1, 60 - elapsed + f * 60)
end
if rpm > 0 then
  local p = tonumber(redis.call('GET', KEYS[1]) or '0')
  local c = tonumber(redis.call('GET', KEYS[2]) or '0')
  if p * (1 - frac) + c + 1 > rpm then return {'rpm', tostring(wait(p, c, 1, rpm))} end
end
if tpm > 0 then
  local p = tonumber(redis.call('GET', KEYS[3]) or '0')
  local c = tonumber(redis.call('GET', KEYS[4]) or '0')
  if p * (1 - frac) + c + tokens > tpm then return {'tpm', tostring(wait(p, c, tokens, tpm))} end
end
if daily > 0 then
  local d = tonumber(redis.call('GET', KEYS[5]) or '0')
  if d + tokens > daily then return {'daily', '-1'} end
end
if rpm > 0 then redis.call('INCR', KEYS[2]); redis.call('EXPIRE', KEYS[2], 130) end
if tpm > 0 then redis.call('INCRBY', KEYS[4], tokens); redis.call('EXPIRE', KEYS[4], 130) end
if daily > 0 then redis.call('INCRBY', KEYS[5], tokens); redis.call('EXPIRE', KEYS[5], 180000) end
return {'ok'}
"""

# KEYS: tokens(window), day.  ARGV: delta.  Only existing counters are adjusted (never resurrected).
_SETTLE_LUA = """
for i = 1, 2 do
  if redis.call('EXISTS', KEYS[i]) == 1 then redis.call('INCRBY', KEYS[i], ARGV[1]) end
end
return 1
"""


class RedisLimiter:
    """Limits shared by every gateway on one Redis (standalone or Cluster: a key's counters share a slot)."""

    def __init__(self, client: Any, *, prefix: str = "sarv:", fail_open: bool = True) -> None:
        """``client``: a ``redis.asyncio.Redis`` or ``RedisCluster`` (typed Any: the types-redis stubs lag
        redis-py 5+, which added ``aclose`` and cluster scripting)."""
        self._client = client
        self._prefix = prefix
        self._fail_open = fail_open
        self._warned_at = -1e18
        self._pending: dict[tuple[str, int, int], int] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._flush_interval = 0.05
        self._admit = client.register_script(_ADMIT_LUA)
        self._settle = client.register_script(_SETTLE_LUA)

    def _k(self, key: str, kind: str, n: int) -> str:
        # {key} is a Cluster hash tag: all counters of one API key live in one slot, so one script sees them.
        return f"{self._prefix}rl:{{{key}}}:{kind}:{n}"

    async def admit(self, key: str, limits: KeyLimits, tokens: int, now: float) -> Decision:
        from redis.exceptions import RedisError

        window = int(now // _WINDOW)
        day = int(now // _DAY)
        elapsed = now - window * _WINDOW
        if limits.tpm is not None:
            tokens = min(tokens, limits.tpm)
        keys = [
            self._k(key, "r", window - 1),
            self._k(key, "r", window),
            self._k(key, "t", window - 1),
            self._k(key, "t", window),
            self._k(key, "d", day),
        ]
        args: list[str | int] = [
            f"{elapsed:.6f}",
            limits.rpm or 0,
            limits.tpm or 0,
            limits.daily_tokens or 0,
            tokens,
        ]
        try:
            res = await self._admit(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            if now - self._warned_at >= 10.0:  # one line per 10 s, not one per request
                self._warned_at = now
                logger.warning(
                    "rate limiter unreachable (%s); %s",
                    exc,
                    "admitting (fail open)" if self._fail_open else "refusing",
                )
            return Decision(self._fail_open, "limiter_unavailable", 1.0, backend_error=True)
        tag = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
        if tag == "ok":
            return Decision(True, reservation=Reservation(key, tokens, window, day))
        wait = float(res[1])
        if tag == "daily":
            wait = (day + 1) * _DAY - now
        return Decision(False, tag, max(1.0, math.ceil(wait)))

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """Queue the correction; a flusher applies all corrections of a key together every 50 ms.

        One Redis call per key and interval instead of one per request: settlement is off the hot path,
        and a reservation standing 50 ms longer only limits a key slightly early, never late.
        """
        delta = actual_tokens - reservation.tokens
        if delta == 0:
            return
        slot = (reservation.key, reservation.window, reservation.day)
        self._pending[slot] = self._pending.get(slot, 0) + delta
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        await asyncio.sleep(self._flush_interval)
        await self.flush()

    async def flush(self) -> None:
        """Apply the queued settlements now."""
        from redis.exceptions import RedisError

        pending, self._pending = self._pending, {}
        calls = [
            self._settle(keys=[self._k(key, "t", window), self._k(key, "d", day)], args=[delta])
            for (key, window, day), delta in pending.items()
            if delta
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, RedisError | OSError)]
        if errors:
            # Losing a settlement only leaves the reservation standing: the key is limited a little early.
            logger.warning("rate limiter: %d settlement(s) lost (%s)", len(errors), errors[0])

    async def close(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
        if self._pending:
            await self.flush()
        await self._client.aclose()
