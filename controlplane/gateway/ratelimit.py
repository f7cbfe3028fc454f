"""Request and token limits of keys, teams and the organisation: a sliding-window counter, atomic in Redis
(Lua) or in one process."""

from __future__ import annotations

import asyncio
import calendar
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import redis.asyncio
    from redis.commands.core import AsyncScript

# The window is the "sliding window counter" of two fixed one-minute buckets: the estimate is
# ``previous × (1 − elapsed/60) + current``. It needs two integers per key and limit (no per-request
# entries) and is exact at the window boundary, pessimistic between. Tokens are reserved at admission
# (prompt + ``max_tokens`` or a default) and settled with the real usage at completion, into the bucket the
# reservation was booked in. The daily and monthly quotas are UTC-day and UTC-month counters.
#
# A limiter knows *subjects* (an API key, a team, the organisation), each with its own counters under its
# own Cluster hash tag. A request is admitted by each level in turn (:func:`admit_levels`); when a later
# level refuses, the earlier admissions are cancelled (given back). Every level books before it admits,
# so the over-admission bound of one level holds for each level, whatever the others do.

__all__ = [
    "Admitted",
    "Decision",
    "InProcessLimiter",
    "KeyLimits",
    "Level",
    "RateLimiter",
    "RedisLimiter",
    "Refused",
    "Reservation",
    "admit_levels",
    "month_of_day",
]

logger = logging.getLogger(__name__)

_WINDOW = 60.0
_DAY = 86400.0


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """One subject's limits (None: no limit of that kind)."""

    rpm: int | None = None
    tpm: int | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None

    @property
    def unlimited(self) -> bool:
        return (
            self.rpm is None
            and self.tpm is None
            and self.daily_tokens is None
            and self.monthly_tokens is None
        )


@dataclass(frozen=True, slots=True)
class Level:
    """One level a request is admitted by: the key, its team or the organisation."""

    kind: str
    """``key``, ``team`` or ``organisation`` (named in refusals)."""
    name: str
    """The key's or team's name ("" for the organisation), for people."""
    subject: str
    """The limiter's id of the counters (no braces: it becomes a Cluster hash tag)."""
    limits: KeyLimits
    models: tuple[str, ...] = ()
    """Allowed models; empty: all."""
    max_prompt_tokens: int | None = None

    @property
    def label(self) -> str:
        """``API key 'bot'``, ``team 'ml'``, ``the organisation``."""
        if self.kind == "organisation":
            return "the organisation"
        return f"{'API key' if self.kind == 'key' else self.kind} '{self.name}'"


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
    remaining_requests: int | None = None
    """What is left of the ``rpm`` after this admission (an estimate across gateways); None: no rpm."""
    remaining_tokens: int | None = None
    """The same for the ``tpm``."""


class RateLimiter(Protocol):
    """Admission and settlement; implementations are safe under concurrent calls from one event loop."""

    async def admit(self, key: str, limits: KeyLimits, tokens: int, now: float) -> Decision: ...
    async def settle(self, reservation: Reservation, actual_tokens: int) -> None: ...
    async def cancel(self, reservation: Reservation) -> None:
        """Give an admission back entirely (the request and its tokens): a later level refused it."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Refused:
    """The level and limit that refused a request, and the decision."""

    level: Level
    decision: Decision


@dataclass(frozen=True, slots=True)
class Admitted:
    """Every level's reservation, and the tightest level's remaining requests and tokens."""

    reservations: tuple[Reservation, ...]
    requests: tuple[int, int] | None = None
    """(limit, remaining) of the level with the fewest requests left; None: no level has an rpm."""
    tokens: tuple[int, int] | None = None
    """(limit, remaining) of the level with the fewest tokens left."""
    unchecked: int = 0
    """Levels admitted without a check because the limiter's backend was unreachable (fail open)."""


async def admit_levels(
    limiter: RateLimiter, levels: tuple[Level, ...], tokens: int, now: float
) -> Admitted | Refused:
    """Admit by every level with limits, in order; a refusal cancels the admissions before it.

    Sequential, not concurrent: most admissions come from a lease without a Redis call, and tasks per
    level would cost more than they save.
    """
    reservations: list[Reservation] = []
    unchecked = 0
    req: tuple[int, int] | None = None
    tok: tuple[int, int] | None = None
    for level in levels:
        limits = level.limits
        if limits.unlimited:
            continue
        decision = await limiter.admit(level.subject, limits, tokens, now)
        if not decision.allowed:
            for r in reservations:
                await limiter.cancel(r)
            return Refused(level, decision)
        if decision.reservation is not None:
            reservations.append(decision.reservation)
        unchecked += decision.backend_error
        left = decision.remaining_requests
        if limits.rpm is not None and left is not None and (req is None or left < req[1]):
            req = (limits.rpm, left)
        left = decision.remaining_tokens
        if limits.tpm is not None and left is not None and (tok is None or left < tok[1]):
            tok = (limits.tpm, left)
    return Admitted(tuple(reservations), req, tok, unchecked)


_MONTHS: dict[int, tuple[int, float]] = {}


def month_of_day(day: int) -> tuple[int, float]:
    """The UTC month (``year × 12 + month − 1``) of a UTC day number, and the epoch second it ends."""
    hit = _MONTHS.get(day)
    if hit is None:
        t = time.gmtime(day * _DAY)
        year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
        end = calendar.timegm((year, month, 1, 0, 0, 0))
        if len(_MONTHS) > 64:
            _MONTHS.clear()
        hit = _MONTHS[day] = (t.tm_year * 12 + t.tm_mon - 1, float(end))
    return hit


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
        left: list[int | None] = [None, None]
        for i, (kind, limit, need) in enumerate(checks):
            if limit is None:
                continue
            prev, cur = self._get(key, kind, window - 1), self._get(key, kind, window)
            used = prev * (1 - frac) + cur
            if used + need > limit:
                reason = "rpm" if kind == "r" else "tpm"
                return Decision(False, reason, _wait(prev, cur, need, limit, elapsed))
            left[i] = max(0, math.floor(limit - used - need))
        if limits.daily_tokens is not None and self._get(key, "d", day) + tokens > limits.daily_tokens:
            return Decision(False, "daily", max(1.0, (day + 1) * _DAY - now))
        month, month_end = month_of_day(day)
        if limits.monthly_tokens is not None and self._get(key, "m", month) + tokens > limits.monthly_tokens:
            return Decision(False, "monthly", max(1.0, month_end - now))
        counts = self._counts.setdefault(key, {})
        for stale in [
            k
            for k in counts
            if (k[0] in "rt" and k[1] < window - 1)
            or (k[0] == "d" and k[1] < day)
            or (k[0] == "m" and k[1] < month)
        ]:
            del counts[stale]
        counts[("r", window)] = counts.get(("r", window), 0.0) + 1
        counts[("t", window)] = counts.get(("t", window), 0.0) + tokens
        counts[("d", day)] = counts.get(("d", day), 0.0) + tokens
        counts[("m", month)] = counts.get(("m", month), 0.0) + tokens
        return Decision(
            True,
            reservation=Reservation(key, tokens, window, day),
            remaining_requests=left[0],
            remaining_tokens=left[1],
        )

    def _adjust(self, reservation: Reservation, requests: int, tokens: int) -> None:
        counts = self._counts.setdefault(reservation.key, {})
        month = month_of_day(reservation.day)[0]
        slots = (
            (("r", reservation.window), requests),
            (("t", reservation.window), tokens),
            (("d", reservation.day), tokens),
            (("m", month), tokens),
        )
        for slot, delta in slots:
            if delta and slot in counts:
                counts[slot] = max(0.0, counts[slot] + delta)

    async def settle(self, reservation: Reservation, actual_tokens: int) -> None:
        self._adjust(reservation, 0, actual_tokens - reservation.tokens)

    async def cancel(self, reservation: Reservation) -> None:
        self._adjust(reservation, -1, -reservation.tokens)

    async def close(self) -> None:
        self._counts.clear()


# KEYS: requests(prev, cur), tokens(prev, cur), day, month.
# ARGV: elapsed, rpm, tpm, daily, need_requests, need_tokens, want_requests, want_tokens, monthly (0 = none).
# Grants between ``need`` and ``want`` (a lease: the gateway admits from it locally), booking what it grants;
# returns {"ok", requests, tokens, rpm left, tpm left (-1: no such limit)} or {reason, seconds-as-string}
# when not even ``need`` fits (Redis truncates Lua numbers to integers, hence the string).
_ADMIT_LUA = """
local elapsed = tonumber(ARGV[1])
local rpm = tonumber(ARGV[2])
local tpm = tonumber(ARGV[3])
local daily = tonumber(ARGV[4])
local need_r = tonumber(ARGV[5])
local need_t = tonumber(ARGV[6])
local gr = tonumber(ARGV[7])
local gt = tonumber(ARGV[8])
local monthly = tonumber(ARGV[9])
local room_r, room_t = -1, -1
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
  room_r = room
end
if tpm > 0 then
  local p = tonumber(redis.call('GET', KEYS[3]) or '0')
  local c = tonumber(redis.call('GET', KEYS[4]) or '0')
  local room = math.floor(tpm - (p * (1 - frac) + c))
  if room < need_t or (need_r > 0 and room < 0) then
    return {'tpm', tostring(wait(p, c, need_t, tpm))}
  end
  gt = math.max(0, math.min(gt, room))
  room_t = room
end
if daily > 0 then
  local room = daily - tonumber(redis.call('GET', KEYS[5]) or '0')
  if room < need_t or (need_r > 0 and room < 0) then return {'daily', '-1'} end
  gt = math.max(0, math.min(gt, room))
end
if monthly > 0 then
  local room = monthly - tonumber(redis.call('GET', KEYS[6]) or '0')
  if room < need_t or (need_r > 0 and room < 0) then return {'monthly', '-1'} end
  gt = math.max(0, math.min(gt, room))
end
if gr == 0 or gt < need_t then return {'ok', 0, 0, room_r, room_t} end  -- a top-up that found no room
if rpm > 0 then redis.call('INCRBY', KEYS[2], gr); redis.call('EXPIRE', KEYS[2], 130) end
if tpm > 0 then redis.call('INCRBY', KEYS[4], gt); redis.call('EXPIRE', KEYS[4], 130) end
if daily > 0 then redis.call('INCRBY', KEYS[5], gt); redis.call('EXPIRE', KEYS[5], 180000) end
if monthly > 0 then redis.call('INCRBY', KEYS[6], gt); redis.call('EXPIRE', KEYS[6], 2764800) end
if room_r >= 0 then room_r = room_r - gr end
if room_t >= 0 then room_t = room_t - gt end
return {'ok', gr, gt, room_r, room_t}
"""

# KEYS: requests(window), tokens(window), day, month.  ARGV: request delta, token delta.  Only existing
# counters are adjusted (never resurrected), and never below zero.
_SETTLE_LUA = """
local deltas = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[2]), tonumber(ARGV[2])}
for i = 1, 4 do
  if deltas[i] ~= 0 and redis.call('EXISTS', KEYS[i]) == 1 then
    if redis.call('INCRBY', KEYS[i], deltas[i]) < 0 then redis.call('SET', KEYS[i], 0, 'KEEPTTL') end
  end
end
return 1
"""

_UNBOUNDED = 1 << 62

# What redis-py's asyncio transport lets escape for a connection torn down under a write, instead of a
# ConnectionError (redis/redis-py#4287): a backend failure like any other, never a 500.
_TRANSPORT_BUGS = (AttributeError, TypeError)


def _left(room: int, lease: int) -> int:
    """Left of a limit as this gateway sees it: Redis's rest plus its own lease's (-1: no such limit)."""
    return -1 if room < 0 else room + lease


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
    room_r: int = -1
    """What Redis had left of the rpm after the last booking (-1: no rpm), for the x-ratelimit headers."""
    room_t: int = -1


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
        max_inflight: int = 48,
        settle_interval: float = 0.25,
    ) -> None:
        """``client``: from :func:`controlplane.state.clients.async_client` (a ``redis.asyncio.Redis`` or
        ``RedisCluster``). ``lease_fraction`` 0 turns leases off. ``max_inflight`` bounds the Redis calls
        under way at once; keep it below the client's connections per node: redis-py's Cluster client
        fails a command beyond them at once, and the reconnect that follows breaks the calls in flight.
        ``settle_interval``: how often the settlements queued meanwhile go to Redis (one call per key)."""
        self._client = client
        self._prefix = prefix
        self._fail_open = fail_open
        self._lease_fraction = lease_fraction
        self._lease_ttl = lease_ttl
        self._warned_at = -1e18
        self._pending: dict[tuple[str, int, int], list[int]] = {}
        self._leases: dict[str, _Lease] = {}
        self._sizes: dict[KeyLimits, tuple[int, int]] = {}
        self._topping: dict[str, asyncio.Task[None]] = {}
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._flush_interval = settle_interval
        self._closing = False
        self._initialised = False
        self._init_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(max_inflight)
        self._admit = client.register_script(_ADMIT_LUA)
        self._settle = client.register_script(_SETTLE_LUA)

    def _k(self, key: str, kind: str, n: int) -> str:
        # {key} is a Cluster hash tag: all counters of one API key live in one slot, so one script sees them.
        return f"{self._prefix}rl:{{{key}}}:{kind}:{n}"

    def _lease_size(self, limits: KeyLimits, tokens: int) -> tuple[int, int] | None:
        """(requests, tokens) of a lease for this key, or None when its limits are too small for one."""
        size = self._sizes.get(limits)
        if size is None:
            f = self._lease_fraction
            size_r = _UNBOUNDED if limits.rpm is None else int(limits.rpm * f)
            token_limits = [
                x for x in (limits.tpm, limits.daily_tokens, limits.monthly_tokens) if x is not None
            ]
            size_t = min(int(x * f) for x in token_limits) if token_limits else _UNBOUNDED
            if len(self._sizes) >= 4096:  # limits change rarely; start over rather than grow
                self._sizes.clear()
            # (0, 0) when leases are off: too small for any request
            size = self._sizes[limits] = (min(size_r, 1 << 31), min(size_t, 1 << 40)) if f > 0 else (0, 0)
        if size[0] < 2 or size[1] < 2 * tokens:
            return None
        return size

    async def admit(self, key: str, limits: KeyLimits, tokens: int, now: float) -> Decision:
        window = int(now // _WINDOW)
        day = int(now // _DAY)
        if limits.tpm is not None:
            tokens = min(tokens, limits.tpm)
        size = self._lease_size(limits, tokens)
        if size is None:
            res = await self._call(key, limits, now, (1, tokens), (1, tokens))
            if isinstance(res, Decision):
                return res
            return self._admitted(key, tokens, window, day, left=(res[2], res[3]))
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
        left_r, left_t = res[2], res[3]
        if res[0] > 1 or res[1] > tokens:
            lease = self._add_lease(key, limits, res, (1, tokens), at=(window, day), size=size)
            left_r, left_t = _left(lease.room_r, lease.requests), _left(lease.room_t, lease.tokens)
        return self._admitted(key, tokens, window, day, left=(left_r, left_t))

    @staticmethod
    def _admitted(key: str, tokens: int, window: int, day: int, *, left: tuple[int, int]) -> Decision:
        return Decision(
            True,
            reservation=Reservation(key, tokens, window, day),
            remaining_requests=None if left[0] < 0 else left[0],
            remaining_tokens=None if left[1] < 0 else left[1],
        )

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
        return self._admitted(
            key,
            tokens,
            window,
            day,
            left=(_left(lease.room_r, lease.requests), _left(lease.room_t, lease.tokens)),
        )

    async def _call(
        self,
        key: str,
        limits: KeyLimits,
        now: float,
        need: tuple[int, int],
        want: tuple[int, int],
    ) -> tuple[int, int, int, int] | Decision:
        """One Lua call: (requests, tokens) granted and (requests, tokens) left in Redis (-1: no such
        limit), or the refusal (or the backend failure) as a Decision."""
        from redis.exceptions import RedisClusterException, RedisError

        window = int(now // _WINDOW)
        day = int(now // _DAY)
        keys = [
            self._k(key, "r", window - 1),
            self._k(key, "r", window),
            self._k(key, "t", window - 1),
            self._k(key, "t", window),
            self._k(key, "d", day),
            self._k(key, "m", month_of_day(day)[0]),
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
            limits.monthly_tokens or 0,
        ]
        try:
            async with self._slots:
                res = await self._script(self._admit, keys, args)
        except (RedisError, RedisClusterException, OSError, *_TRANSPORT_BUGS) as exc:
            self._warn_unreachable(exc, now)
            return Decision(self._fail_open, "limiter_unavailable", 1.0, backend_error=True)
        tag = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
        if tag == "ok":
            return int(res[1]), int(res[2]), int(res[3]), int(res[4])
        wait = float(res[1])
        if tag == "daily":
            wait = (day + 1) * _DAY - now
        elif tag == "monthly":
            wait = month_of_day(day)[1] - now
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
        res: tuple[int, int, int, int],
        taken: tuple[int, int],
        *,
        at: tuple[int, int],
        size: tuple[int, int],
    ) -> _Lease:
        """Add what Redis granted (booked in the bucket ``at`` = (window, day)) to the key's lease, less
        the (requests, tokens) ``taken`` by the admission that booked it ((0, 0): a top-up)."""
        window, day = at
        granted = (res[0] - taken[0], res[1] - taken[1])
        lease = self._leases.get(key)
        if lease is not None and lease.window == window and lease.day == day:
            lease.requests += granted[0]
            lease.tokens += granted[1]
            lease.expires = time.monotonic() + self._lease_ttl
            lease.room_r, lease.room_t = res[2], res[3]
            return lease
        if lease is not None:
            self._retire(key)
        lease = self._leases[key] = _Lease(
            requests=granted[0],
            tokens=granted[1],
            window=window,
            day=day,
            expires=time.monotonic() + self._lease_ttl,
            size_r=size[0],
            size_t=size[1],
            booked_r=limits.rpm is not None,
            booked_t=not (
                limits.tpm is None and limits.daily_tokens is None and limits.monthly_tokens is None
            ),
            room_r=res[2],
            room_t=res[3],
        )
        self._schedule_flush()
        return lease

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
                self._add_lease(key, limits, res, (0, 0), at=at, size=(lease.size_r, lease.size_t))
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
        """Queue the correction; a flusher applies all corrections of a key together every
        ``settle_interval`` (250 ms).

        One Redis call per key and interval instead of one per request: settlement is off the hot path,
        and a reservation standing 250 ms longer only limits a key slightly early, never late. Under steady
        load each limited level (key, team, organisation) costs one call per interval.
        """
        delta = actual_tokens - reservation.tokens
        if delta == 0:
            return
        slot = self._pending.setdefault((reservation.key, reservation.window, reservation.day), [0, 0])
        slot[1] += delta
        self._schedule_flush()

    async def cancel(self, reservation: Reservation) -> None:
        """Queue the return of the request and its tokens (applied with the settlements)."""
        slot = self._pending.setdefault((reservation.key, reservation.window, reservation.day), [0, 0])
        slot[0] -= 1
        slot[1] -= reservation.tokens
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_soon())

    async def _flush_soon(self) -> None:
        # While leases are held, keep ticking: an expired lease goes back even if its key goes quiet.
        while not self._closing:
            await asyncio.sleep(self._flush_interval)
            await self.flush()
            if not self._leases and not self._pending:
                return

    async def flush(self, *, all_leases: bool = False) -> None:
        """Apply the queued settlements and give back expired leases (every lease with ``all_leases``)."""
        from redis.exceptions import RedisClusterException, RedisError

        mono = time.monotonic()
        for key in [k for k, v in self._leases.items() if all_leases or v.expires <= mono]:
            self._retire(key)
        pending, self._pending = self._pending, {}
        calls = [
            self._bounded_settle(
                keys=[
                    self._k(key, "r", window),
                    self._k(key, "t", window),
                    self._k(key, "d", day),
                    self._k(key, "m", month_of_day(day)[0]),
                ],
                args=[d_req, d_tok],
            )
            for (key, window, day), (d_req, d_tok) in pending.items()
            if d_req or d_tok
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [
            r
            for r in results
            if isinstance(r, (RedisError, RedisClusterException, OSError, *_TRANSPORT_BUGS))
        ]
        if errors:
            # Losing a settlement only leaves the reservation standing: the key is limited a little early.
            logger.warning("rate limiter: %d settlement(s) lost (%s)", len(errors), errors[0])

    async def _bounded_settle(self, keys: list[str], args: list[str | int]) -> object:
        async with self._slots:
            return await self._script(self._settle, keys, args)

    async def _script(self, script: AsyncScript, keys: list[str], args: list[str | int]) -> Any:
        """Run a script, the client initialised first.

        A ``RedisCluster`` that meets its first commands concurrently reads the slot map once per command
        and replaces the nodes (and their connections) under the others' feet: they fail with the
        transport's own AttributeError (redis-py 8.1). Initialised once, up front, it does not.
        """
        if not self._initialised:
            async with self._init_lock:
                if not self._initialised:
                    await self._client.initialize()
                    self._initialised = True
        return await script(keys=keys, args=args)

    async def close(self) -> None:
        # The flusher is let finish, not cancelled: a flush cancelled in flight loses the settlements it
        # had taken (and leaves a Cluster connection mid-command).
        self._closing = True
        if self._flusher is not None and not self._flusher.done():
            await asyncio.gather(self._flusher, return_exceptions=True)
        # Top-ups are awaited, not cancelled: one whose booking already reached Redis would otherwise leave
        # that booking behind with no lease to return it from (the client's timeouts bound the wait).
        await asyncio.gather(*list(self._topping.values()), return_exceptions=True)
        if self._pending or self._leases:
            await self.flush(all_leases=True)
        await self._client.aclose()
