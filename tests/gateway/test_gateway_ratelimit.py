"""Rate limits: the sliding-window counter in one process and atomically in a real Redis."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fixtures.common import free_port
from fixtures.gateway import add_key, add_replica, make_store

from controlplane.gateway import GatewayConfig
from controlplane.gateway.ratelimit import InProcessLimiter, KeyLimits, RedisLimiter

T0 = 1_700_000_040.0  # a window boundary (divisible by 60): the previous bucket's weight is exactly 1


def _redis_limiter(url: str, **kw) -> RedisLimiter:
    from redis.asyncio import BlockingConnectionPool, Redis

    # Generous timeouts: the test machines are shared, and a timeout would count as a backend error.
    pool = BlockingConnectionPool.from_url(
        url, max_connections=16, timeout=10, socket_connect_timeout=5, socket_timeout=5
    )
    return RedisLimiter(Redis.from_pool(pool), **kw)


def _evalsha_calls(url: str) -> int:
    import redis

    with redis.Redis.from_url(url) as r:
        return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def _counter(url: str, key: str, kind: str, n: int) -> int:
    import redis

    with redis.Redis.from_url(url) as r:
        return int(r.get(f"sarv:rl:{{{key}}}:{kind}:{n}") or 0)


async def test_in_process_rpm_tpm_daily():
    lim = InProcessLimiter()
    limits = KeyLimits(rpm=3)
    got = [(await lim.admit("k", limits, 1, T0 + i)).allowed for i in range(5)]
    assert got == [True, True, True, False, False]
    refused = await lim.admit("k", limits, 1, T0 + 5)
    assert refused.reason == "rpm"
    assert refused.retry_after >= 1
    # the next window still carries most of the previous one (sliding, not fixed)
    assert not (await lim.admit("k", limits, 1, T0 + 61)).allowed
    assert (await lim.admit("k", limits, 1, T0 + 120)).allowed

    tpm = KeyLimits(tpm=100)
    d = await lim.admit("t", tpm, 80, T0)
    assert d.allowed
    assert not (await lim.admit("t", tpm, 30, T0)).allowed
    # settling with the real (smaller) usage gives the rest back
    assert d.reservation is not None
    await lim.settle(d.reservation, 20)
    assert (await lim.admit("t", tpm, 30, T0 + 1)).allowed

    daily = KeyLimits(daily_tokens=50)
    assert (await lim.admit("d", daily, 40, T0)).allowed
    refused = await lim.admit("d", daily, 40, T0 + 3600)
    assert refused.reason == "daily"
    assert refused.retry_after == pytest.approx(86400 - (T0 + 3600) % 86400)  # until UTC midnight


@pytest.mark.redis
async def test_redis_limiter_matches_semantics(redis_url):
    lim = _redis_limiter(redis_url)
    try:
        limits = KeyLimits(rpm=3, tpm=100)
        got = [(await lim.admit("k", limits, 10, T0 + i)).allowed for i in range(5)]
        assert got == [True, True, True, False, False]
        d = await lim.admit("t", KeyLimits(tpm=100), 80, T0)
        assert d.allowed
        assert d.reservation is not None
        assert not (await lim.admit("t", KeyLimits(tpm=100), 30, T0)).allowed
        await lim.settle(d.reservation, 20)
        assert not (await lim.admit("t", KeyLimits(tpm=100), 30, T0)).allowed  # settlements are batched …
        await lim.flush()  # … and applied together
        assert (await lim.admit("t", KeyLimits(tpm=100), 30, T0 + 1)).allowed
        refused = await lim.admit("d", KeyLimits(daily_tokens=5), 10, T0)
        assert refused.allowed is False
        assert refused.reason == "daily"
    finally:
        await lim.close()


@pytest.mark.redis
@pytest.mark.parametrize(
    ("limit", "requests", "least"),
    [
        # rpm 500: too small for leases (500 × 0.002 = 1), every admission is checked in Redis: exact
        (500, 2_000, 0.99),
        # rpm 10,000: leases of 20; at most one lease (0.2 % of the limit) per gateway is held back
        (10_000, 16_000, 1 - 4 * 0.002),
    ],
    ids=["per-request", "leased"],
)
async def test_concurrent_admission_across_gateways_does_not_over_admit(redis_url, limit, requests, least):
    # Four limiters = four gateways sharing one Redis, all admissions at once, in one minute.
    # fail closed: an admission the limiter could not check must not count as admitted
    limiters = [_redis_limiter(redis_url, fail_open=False) for _ in range(4)]
    try:

        async def one(i: int) -> tuple[bool, bool]:
            d = await limiters[i % 4].admit("shared", KeyLimits(rpm=limit), 1, T0 + (i % 50) / 100)
            return d.allowed, d.backend_error

        results = await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        for lim in limiters:
            await lim.close()
    assert not any(err for _, err in results)
    admitted = sum(ok for ok, _ in results)
    assert admitted <= limit
    assert admitted >= limit * least  # and it does not under-admit either
    # leases given back on close: Redis counts exactly what was admitted
    assert _counter(redis_url, "shared", "r", int(T0 // 60)) == admitted


@pytest.mark.redis
async def test_tokens_under_concurrency_with_settlement(redis_url):
    lim = _redis_limiter(redis_url)
    tpm = 10_000
    try:

        async def one(i: int) -> int:
            d = await lim.admit("tok", KeyLimits(tpm=tpm), 100, T0 + i / 1000)
            if not d.allowed or d.reservation is None:
                return 0
            await lim.settle(d.reservation, 50)  # used half of what it reserved
            await lim.flush()
            return 50

        used = sum(await asyncio.gather(*(one(i) for i in range(400))))
    finally:
        await lim.close()
    # settled usage never exceeds the limit by more than 1 %
    assert used <= tpm * 1.01
    assert used >= tpm // 2  # reservations alone would admit 100; settlement lets more through


@pytest.mark.redis
async def test_busy_key_is_admitted_from_a_lease(redis_url):
    # rpm 20,000 × 0.002: leases of 40 requests, so 400 admissions need about 400 / 20 Redis calls, not 400
    lim = _redis_limiter(redis_url)
    limits = KeyLimits(rpm=20_000, tpm=100_000_000)
    before = _evalsha_calls(redis_url)
    try:
        for i in range(400):
            assert (await lim.admit("busy", limits, 100, T0 + i / 1000)).allowed
            await asyncio.sleep(0)  # let a background top-up run, as it would between requests
    finally:
        await lim.close()
    calls = _evalsha_calls(redis_url) - before
    assert calls <= 400 // 10, calls
    # every booked-but-unused admission went back on close: the counters hold exactly what was admitted
    window = int(T0 // 60)
    assert _counter(redis_url, "busy", "r", window) == 400
    assert _counter(redis_url, "busy", "t", window) == 400 * 100


@pytest.mark.redis
async def test_unused_lease_goes_back_after_its_ttl(redis_url):
    lim = _redis_limiter(redis_url, lease_ttl=0.1)
    window = int(T0 // 60)
    try:
        assert (await lim.admit("idle", KeyLimits(rpm=5_000), 1, T0)).allowed
        assert _counter(redis_url, "idle", "r", window) == 10  # one admitted, nine leased
        for _ in range(100):  # the flusher gives the rest back once the lease expires
            await asyncio.sleep(0.05)
            if _counter(redis_url, "idle", "r", window) == 1:
                break
        assert _counter(redis_url, "idle", "r", window) == 1
    finally:
        await lim.close()


@pytest.mark.redis
async def test_lease_is_not_used_across_a_window_boundary(redis_url):
    lim = _redis_limiter(redis_url)
    window = int(T0 // 60)
    limits = KeyLimits(rpm=5_000)
    try:
        assert (await lim.admit("edge", limits, 1, T0 + 59.9)).allowed
        before = _evalsha_calls(redis_url)
        assert (await lim.admit("edge", limits, 1, T0 + 60.1)).allowed
        assert _evalsha_calls(redis_url) == before + 1  # the new minute books in Redis again
        await lim.flush()
        assert _counter(redis_url, "edge", "r", window) == 1  # the old lease's rest went back
        assert _counter(redis_url, "edge", "r", window + 1) == 10
    finally:
        await lim.close()


@pytest.mark.parametrize("fail_open", [True, False])
async def test_unreachable_redis_follows_the_setting(fail_open):
    lim = _redis_limiter(f"redis://127.0.0.1:{free_port()}/0", fail_open=fail_open)
    try:
        d = await lim.admit("k", KeyLimits(rpm=1), 1, T0)
    finally:
        await lim.close()
    assert d.backend_error
    assert d.allowed is fail_open


@pytest.fixture
def limited_gateway(tmp_path, sim_server, gateway_factory):
    sim = sim_server(served_model_name="m1", latency_mode="fixed", fixed_ttft_ms=1, fixed_output_tokens=2)
    store = make_store(tmp_path)
    add_replica(store, sim.url, "m1", rid="m1-0")
    return store, lambda **kw: gateway_factory(store, GatewayConfig(), **kw)


def test_gateway_answers_429_with_retry_after(limited_gateway):
    store, start = limited_gateway
    key = add_key(store, "rl", rpm=3)
    gw = start()
    codes = []
    for _ in range(5):
        r = httpx.post(
            f"{gw.url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "m1", "prompt": "x", "max_tokens": 1},
        )
        codes.append(r.status_code)
    assert codes == [200, 200, 200, 429, 429]
    assert int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    metrics = httpx.get(gw.metrics_url).text
    assert 'sarv_gateway_ratelimit_rejections_total{key="rl",reason="rpm",team=""} 2.0' in metrics


def test_gateway_with_redis_down_fails_closed_when_told(limited_gateway):
    store, start = limited_gateway
    key = add_key(store, "rl", rpm=100)
    gw = start(limiter=_redis_limiter(f"redis://127.0.0.1:{free_port()}/0", fail_open=False))
    r = httpx.post(
        f"{gw.url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "m1", "prompt": "x", "max_tokens": 1},
    )
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "ratelimit_unavailable"
    assert (
        'sarv_gateway_ratelimit_backend_errors_total{action="refused"} 1.0' in httpx.get(gw.metrics_url).text
    )
