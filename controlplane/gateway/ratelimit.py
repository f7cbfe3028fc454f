"""Per-key request and token limits: a sliding-window counter, atomic in Redis (Lua) or in one process."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import redis.asyncio

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


# KEYS: requests(prev, cur), tokens(prev, cur), day.
# ARGV: elapsed, rpm, tpm, daily (0 = none), need_requests, need_tokens, want_requests, want_tokens.
# Grants between ``need`` and ``want`` (a lease: the gateway admits from it locally), booking what it grants;
# returns {"ok", requests, tokens} or {reason, seconds-as-string} when not even ``need`` fits (Redis
# truncates Lua numbers to integers, hence the string).
_ADMIT_LUA = """
local elapsed = tonumber(ARGV[1])
local rpm = tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
local daily = tonumber(ARGV[4])
local need_r = tonumber(ARGV[5])
local need_t = tonumber(ARGV[6])
local gr = tonumber(ARGV[7])
local gt = tonumber(ARGV[8])
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
  local room = math.floor(rpm - (p * (1 - frac) + c))
  if room < math.max(need_r, 1) and need_r > 0 then
    return {'rpm', tostring(wait(p, c, need_r, rpm))}
  end
  gr = math.max(0, math.min(gr, room))
end
if tpm > 0 then
  local p = tonumber(redis.call('GET', KEYS[3]) or '0')
  local c = tonumber(redis.call('GET', KEYS[4]) or '0')
  local room = math.floor(tpm - (p * (1 - frac) + c))
  if room < need_t or (need_r > 0 and room < 0) then
    return {'tpm', tostring(wait(p, c, need_t, tpm))}
  end
  gt = math.max(0, math.min(gt, room))
end
if daily > 0 then
  local room = daily - tonumber(redis.call('GET', KEYS[5]) or '0')
  if room < need_t or (need_r > 0 and room < 0) then return {'daily', '-1'} end
  gt = math.max(0, math.min(gt, room))
end
if gr == 0 or gt < need_t then return {'ok', 0, 0} end  -- a top-up that found no room: nothing booked
if rpm > 0 then redis.call('INCRBY', KEYS[2], gr); redis.call('EXPIRE', KEYS[2], 130) end
if tpm > 0 then redis.call('INCRBY', KEYS[4], gt); redis.call('EXPIRE', KEYS[4], 130) end
if daily > 0 then redis.call('INCRBY', KEYS[5], gt); redis.call('EXPIRE', KEYS[5], 180000) end
return {'ok', gr, gt}
"""

# KEYS: requests(window), tokens(window), day.  ARGV: request delta, token delta.  Only existing counters
# are adjusted (never resurrected), and never below zero.
_SETTLE_LUA = """
local deltas = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[2])}
for i = 1, 3 do
  if deltas[i] ~= 0 and redis.call('EXISTS', KEYS[i]) == 1 then
    if redis.call('INCRBY', KEYS[i], deltas[i]) < 0 then redis.call('SET', KEYS[i], 0, 'KEEPTTL') end
  end
end
return 1
"""

_UNBOUNDED = 1 << 62


@dataclass(slots=True)
class _Lease:
    """Admissions already booked in Redis that this gateway hands out locally until ``expires``."""

    requests: int
    tokens: int
    window: int
    day: int
    expires: float
    """``time.monotonic()`` deadline; what is left then goes back to Redis."""
    size_r: int
    size_t: int
    booked_r: bool
    """The requests were booked in Redis (the key has an ``rpm``), so their rest goes back."""
    booked_t: bool


class RedisLimiter:
    """Limits shared by every gateway on one Redis (standalone or Cluster: a key's counters share a slot).

    A Redis round trip per request would put Redis's latency, and the scheduling of a second process, into
    every request's. So a busy key is served from a **lease**: one Lua call books up to ``lease_fraction`` of
    each of the key's limits at once, and the gateway admits from it locally, topping it up in the
    background when half is gone. Whatever is booked counts against the limit in Redis, so several gateways
    together never admit more than the limit; a lease's unused rest goes back after ``lease_ttl`` s (at most
    ``lease_fraction`` of a limit per gateway is held back meanwhile). Limits too small for a lease of more
    than one request (``rpm × lease_fraction < 2``) are checked in Redis on every request.
    """

    def __init__(
        self,
        client: redis.asyncio.Redis | redis.asyncio.RedisCluster,
        *,
        prefix: str = "sarv:",
        fail_open: bool = True,
        lease_fraction: float = 0.002,
        lease_ttl: float = 1.0,
    ) -> None:
        """``client``: from :func:`controlplane.state.clients.async_client` (a ``redis.asyncio.Redis`` or
        ``RedisCluster``). ``lease_fraction`` 0 turns leases off."""
        self._client = client
        self._prefix = prefix
        self._fail_open = fail_open
        self._lease_fraction = lease_fraction
        self._lease_ttl = lease_ttl
        self._warned_at = -1e18
        self._pending: dict[tuple[str, int, int], list[int]] = {}
        self._leases: dict[str, _Lease] = {}
        self._topping: dict[str, asyncio.Task[None]] = {}
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._flush_interval = 0.05
        self._admit = client.register_script(_ADMIT_LUA)
        self._settle = client.register_script(_SETTLE_LUA)

    def _k(self, key: str, kind: str, n: int) -> str:
        # {key} is a Cluster hash tag: all counters of one API key live in one slot, so one script sees them.
        return f"{self._prefix}rl:{{{key}}}:{kind}:{n}"

    def _lease_size(self, limits: KeyLimits, tokens: int) -> tuple[int, int] | None:
        """(requests, tokens) of a lease for this key, or None when its limits are too small for one."""
        f = self._lease_fraction
        if f <= 0:
            return None
        size_r = _UNBOUNDED if limits.rpm is None else int(limits.rpm * f)
        token_limits = [x for x in (limits.tpm, limits.daily_tokens) if x is not None]
        size_t = min(int(x * f) for x in token_limits) if token_limits else _UNBOUNDED
        if size_r < 2 or size_t < 2 * tokens:
            return None
        return min(size_r, 1 << 31), min(size_t, 1 << 40)

    async def admit(self, key: str, limits: KeyLimits, tokens: int, now: float) -> Decision:
        window = int(now // _WINDOW)
        day = int(now // _DAY)
        if limits.tpm is not None:
            tokens = min(tokens, limits.tpm)
        size = self._lease_size(limits, tokens)
        if size is None:
            res = await self._call(key, limits, now, (1, tokens), (1, tokens))
            return res if isinstance(res, Decision) else self._admitted(key, tokens, window, day)
        taken = self._take(key, limits, tokens, now)
        if taken is not None:
            return taken
        # One lease call per key at a time: requests that miss meanwhile wait for it and then draw on it,
        # rather than each booking a lease of its own.
        fut = self._inflight.get(key)
        lead = fut is None
        if fut is None:
            fut = self._inflight[key] = asyncio.get_running_loop().create_future()
        else:
            await asyncio.shield(fut)
            taken = self._take(key, limits, tokens, now)
            if taken is not None:
                return taken
        try:
            res = await self._call(key, limits, now, (1, tokens), size if lead else (1, tokens))
        finally:
            if lead:
                del self._inflight[key]
                fut.set_result(None)
        if isinstance(res, Decision):
            return res
        if res[0] > 1 or res[1] > tokens:
            self._add_lease(key, limits, (res[0] - 1, res[1] - tokens), at=(window, day), size=size)
        return self._admitted(key, tokens, window, day)

    @staticmethod
    def _admitted(key: str, tokens: int, window: int, day: int) -> Decision:
        return Decision(True, reservation=Reservation(key, tokens, window, day))

    def _take(self, key: str, limits: KeyLimits, tokens: int, now: float) -> Decision | None:
        """Admit from the key's lease, or None when it cannot cover this request."""
        lease = self._leases.get(key)
        if lease is None:
            return None
        window = int(now // _WINDOW)
        day = int(now // _DAY)
        if lease.window != window or lease.day != day:
            self._retire(key)  # booked in a bucket that is no longer the current one
            return None
        if lease.requests < 1 or lease.tokens < tokens:
            return None
        lease.requests -= 1
        lease.tokens -= tokens
        low = lease.requests * 2 < lease.size_r or lease.tokens * 2 < lease.size_t
        if low and key not in self._topping:
            self._topping[key] = asyncio.create_task(self._top_up(key, limits, now))
        return self._admitted(key, tokens, window, day)

    async def _call(
        self,
        key: str,
        limits: KeyLimits,
        now: float,
        need: tuple[int, int],
        want: tuple[int, int],
    ) -> tuple[int, int] | Decision:
        """One Lua call: (requests, tokens) granted, or the refusal (or the backend failure) as a Decision."""
        from redis.exceptions import RedisError

        window = int(now // _WINDOW)
        day = int(now // _DAY)
        keys = [
            self._k(key, "r", window - 1),
            self._k(key, "r", window),
            self._k(key, "t", window - 1),
            self._k(key, "t", window),
            self._k(key, "d", day),
        ]
        args: list[str | int] = [
            f"{now - window * _WINDOW:.6f}",
            limits.rpm or 0,
            limits.tpm or 0,
            limits.daily_tokens or 0,
            need[0],
            need[1],
            want[0],
            want[1],
        ]
        try:
            res = await self._admit(keys=keys, args=args)
        except (RedisError, OSError) as exc:
            self._warn_unreachable(exc, now)
            return Decision(self._fail_open, "limiter_unavailable", 1.0, backend_error=True)
        tag = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
        if tag == "ok":
            return int(res[1]), int(res[2])
        wait = float(res[1])
        if tag == "daily":
            wait = (day + 1) * _DAY - now
        return Decision(False, tag, max(1.0, math.ceil(wait)))

    def _warn_unreachable(self, exc: BaseException, now: float) -> None:
        if now - self._warned_at >= 10.0:  # one line per 10 s, not one per request
            self._warned_at = now
            logger.warning(
                "rate limiter unreachable (%s); %s",
                exc,
                "admitting (fail open)" if self._fail_open else "refusing",
            )

    def _add_lease(
        self,
        key: str,
        limits: KeyLimits,
        granted: tuple[int, int],
        *,
        at: tuple[int, int],
        size: tuple[int, int],
    ) -> None:
        """Add what Redis granted (booked in the bucket ``at`` = (window, day)) to the key's lease."""
        window, day = at
        lease = self._leases.get(key)
        if lease is not None and lease.window == window and lease.day == day:
            lease.requests += granted[0]
            lease.tokens += granted[1]
            lease.expires = time.monotonic() + self._lease_ttl
            return
        if lease is not None:
            self._retire(key)
        self._leases[key] = _Lease(
            requests=granted[0],
            tokens=granted[1],
            window=window,
            day=day,
            expires=time.monotonic() + self._lease_ttl,
            size_r=size[0],
            size_t=size[1],
            booked_r=limits.rpm is not None,
            booked_t=limits.tpm is not None or limits.daily_tokens is not None,
        )
        self._schedule_flush()

    async def _top_up(self, key: str, limits: KeyLimits, now: float) -> None:
        """Book the next part of a key's lease while requests still draw on the current one."""
        try:
            lease = self._leases.get(key)
            if lease is None:
                return
            # Back up to the lease's size (already clamped by _lease_size, also without an rpm).
            want = (max(0, lease.size_r - lease.requests), max(0, lease.size_t - lease.tokens))
            if want[0] == 0:
                return
            res = await self._call(key, limits, now, (0, 0), want)
            if isinstance(res, tuple) and res[0] > 0:
                at = (int(now // _WINDOW), int(now // _DAY))
                self._add_lease(key, limits, res, at=at, size=(lease.size_r, lease.size_t))
        finally:
            self._topping.pop(key, None)

    def _retire(self, key: str) -> None:
        """Give a lease's unused part back to the counters it was booked in."""
        lease = self._leases.pop(key, None)
        if lease is None:
            return
        requests = lease.requests if lease.booked_r else 0
        tokens = lease.tokens if lease.booked_t else 0
        if requests or tokens:
            slot = self._pending.setdefault((key, lease.window, lease.day), [0, 0])
            slot[0] -= requests
            slot[1] -= tokens
            self._schedule_flush()

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        """Queue the correction; a flusher applies all corrections of a key together every 50 ms.

        One Redis call per key and interval instead of one per request: settlement is off the hot path,
        and a reservation standing 50 ms longer only limits a key slightly early, never late.
        """
        delta = actual_tokens - reservation.tokens
        if delta == 0:
            return
        slot = self._pending.setdefault((reservation.key, reservation.window, reservation.day), [0, 0])
        slot[1] += delta
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        # While leases are held, keep ticking: an expired lease goes back even if its key goes quiet.
        while True:
            await asyncio.sleep(self._flush_interval)
            await self.flush()
            if not self._leases and not self._pending:
                return

    async def flush(self, *, all_leases: bool = False) -> None:
        """Apply the queued settlements and give back expired leases (every lease with ``all_leases``)."""
        from redis.exceptions import RedisError

        mono = time.monotonic()
        for key in [k for k, v in self._leases.items() if all_leases or v.expires <= mono]:
            self._retire(key)
        pending, self._pending = self._pending, {}
        calls = [
            self._settle(
                keys=[self._k(key, "r", window), self._k(key, "t", window), self._k(key, "d", day)],
                args=[d_req, d_tok],
            )
            for (key, window, day), (d_req, d_tok) in pending.items()
            if d_req or d_tok
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, RedisError | OSError)]
        if errors:
            # Losing a settlement only leaves the reservation standing: the key is limited a little early.
            logger.warning("rate limiter: %d settlement(s) lost (%s)", len(errors), errors[0])

    async def close(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            self._flusher.cancel()
        # Top-ups are awaited, not cancelled: one whose booking already reached Redis would otherwise leave
        # that booking behind with no lease to return it from (the client's timeouts bound the wait).
        await asyncio.gather(*list(self._topping.values()), return_exceptions=True)
        if self._pending or self._leases:
            await self.flush(all_leases=True)
        await self._client.aclose()
