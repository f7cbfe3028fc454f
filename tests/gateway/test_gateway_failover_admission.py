"""A team's rpm across gateways while the Redis Cluster primary holding its counters is SIGKILLed.

Real parts: a 6-process Redis Cluster of this module's own (one master is killed, so not the session's),
three gateways' admission stages (``GatewayApp.admission``: the levels of real key and team records,
``admit_levels``, leases, the 429/503 decisions and their metrics), each with the rate limiter
``llmctl gateway`` builds from settings (``server._limiter``: its own Cluster client, timeouts and
leases). The keys and the team are read from SQLite, so only the limiter meets the failover.

Many admissions run at once on every gateway; once a part of the team's limit is admitted, the master
serving the team's slot is SIGKILLed while bookings are in flight. Its replica is held back (SIGSTOP)
until every gateway has been answered without a primary, because the Redis client retries a failed
command ten times (a few milliseconds to seconds) and a promotion within that time is simply waited out;
then the replica is let run, is promoted, and the admissions go on until the team's limit refuses. The
clock stands still, so the whole run is one minute of the sliding window: the worst case, every
admission counts.

- In that minute the team's checked admissions stay within the bound docs/gateway.md states for a
  failover: the limit, plus the bookings a replication lag under 1 s loses (lag ÷ 60 s of the limit),
  plus one lease per gateway.
- While no primary answers, ``ratelimit_fail_open`` decides: admitted unchecked and counted in
  ``sarv_gateway_ratelimit_backend_errors_total{action="admitted"}``, or refused with 503
  ``ratelimit_unavailable`` and counted as ``refused``; nothing else fails.
- Every gateway is checking again once it has had its first answer from the promoted replica.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fixtures.gateway import add_key, make_store
from fixtures.redis import RedisCluster, failed_over, kill_node, master_of, replica_of, start_cluster

from controlplane.gateway import GatewayApp
from controlplane.gateway.errors import ApiError
from controlplane.gateway.ratelimit import Level
from controlplane.gateway.server import _limiter
from controlplane.settings import Settings
from controlplane.state.base import StateStore, TeamRecord

pytestmark = [pytest.mark.redis, pytest.mark.slow]

T0 = 1_700_000_040.0  # a window boundary: the previous bucket is empty, the estimate is the current one
TEAM_RPM = 10_000
KEY_RPM = 8_000  # each key's own rpm binds after the team's: refusals by the team give the keys' back
LEASE_FRACTION = 0.002  # the default: leases of 20 requests of the team, 16 of a key
GATEWAYS = 3
WORKERS = 6  # concurrent admissions per gateway
LAG_S = 1.0  # the replication lag the documented bound is stated for
KILL_AT = TEAM_RPM * 2 // 5  # checked team admissions before the kill
SUBJECT = "team:ml"
TAG = "{" + SUBJECT + "}"  # the Cluster hash tag of the team's counters
MAX_PER_WORKER = 20_000  # bounds each worker's loop in count ...
DEADLINE_S = 150.0  # ... and the whole run in time


@dataclass
class Outcome:
    gateway: int
    started: float
    ended: float
    what: str
    """``checked`` (the team's counters booked it), ``unchecked`` (admitted without the team's check),
    ``429``, ``503``, or what else came out (the test fails on it)."""
    backend: bool = False
    """A level's limiter could not be asked: admitted unchecked (fail open) or the 503 (fail closed)."""


@dataclass
class Run:
    """What the workers did, and when (``time.monotonic``) the kill and the promotion happened."""

    outcomes: list[Outcome] = field(default_factory=list)
    killed_at: float | None = None
    resumed_at: float | None = None
    """When the held-back replica was let run again."""
    promoted_at: float | None = None
    stop: bool = False

    def count(self, what: str, *, after: float | None = None) -> int:
        return sum(1 for o in self.outcomes if o.what == what and (after is None or o.started >= after))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A cluster of this test's own: the test kills one of its masters."""
    with start_cluster(tmp_path / "redis-cluster") as c:
        yield c


def _gateways(cluster: RedisCluster, store: StateStore, fail_open: bool) -> list[GatewayApp]:
    settings = Settings(
        state_url=cluster.url, ratelimit_fail_open=fail_open, ratelimit_lease_fraction=LEASE_FRACTION
    )
    return [
        GatewayApp(store=store, limiter=_limiter(settings), clock=lambda: T0 + 1.0) for _ in range(GATEWAYS)
    ]


async def _worker(run: Run, index: int, app: GatewayApp, levels: list[tuple[Level, ...]]) -> None:
    try:
        for i in range(MAX_PER_WORKER):
            if run.stop:
                return
            started = time.monotonic()
            backend = False
            try:
                admitted = await app.admission.rate_limit(levels[i % len(levels)], "ml", 10)
            except ApiError as exc:
                # Only the team's limit binds; an unreachable limiter is a 503 of its own.
                level = dict(exc.headers or []).get(b"x-sarv-ratelimit-level")
                documented = (exc.status == 429 and level == b"team") or (
                    exc.status == 503 and exc.code == "ratelimit_unavailable"
                )
                what = str(exc.status) if documented else f"{exc.status} {exc.code}: {exc.message}"
                backend = exc.status == 503
            except Exception as exc:  # recorded: the test fails on anything that escapes
                what = f"{type(exc).__name__}: {exc}"
            else:
                team_booked = any(r.key == SUBJECT for r in admitted.reservations)
                what = "checked" if team_booked else "unchecked"
                backend = admitted.unchecked > 0
            run.outcomes.append(Outcome(index, started, time.monotonic(), what, backend))
            # Paces the workers (about 1,800 admissions a second in all): the outage is no busy loop.
            await asyncio.sleep(0.01)
        pytest.fail(f"a worker ran {MAX_PER_WORKER} admissions without the team's limit stopping the run")
    finally:
        run.stop = True


async def _conductor(run: Run, cluster: RedisCluster, begun: float) -> None:
    """Kill the team's master once ``KILL_AT`` are admitted, hold its replica back until every gateway
    has met the outage, let it be promoted, then go on until the team's limit refuses."""

    def bounded(what: str) -> None:
        assert time.monotonic() - begun < DEADLINE_S, what

    try:
        while run.count("checked") < KILL_AT:
            bounded("the admissions did not reach the kill")
            await asyncio.sleep(0.01)
        dead = await asyncio.to_thread(master_of, cluster, TAG)
        heir = await asyncio.to_thread(replica_of, cluster, dead)
        # The replica is stopped (it keeps what it has received) so that no primary answers for as long
        # as it takes the gateways' Redis client to give up; a failover shorter than that is waited out.
        cluster.procs[heir].send_signal(signal.SIGSTOP)
        try:
            run.killed_at = time.monotonic()
            kill_node(cluster, dead)  # the workers' bookings on it are in flight
            while {o.gateway for o in run.outcomes if o.backend} != set(range(GATEWAYS)):
                bounded("a gateway never met the outage")
                await asyncio.sleep(0.05)
        finally:
            cluster.procs[heir].send_signal(signal.SIGCONT)
        run.resumed_at = time.monotonic()
        while not await asyncio.to_thread(failed_over, cluster, TAG, dead):
            bounded("the cluster did not fail over")
            await asyncio.sleep(0.2)
        run.promoted_at = time.monotonic()
        while run.count("429", after=run.promoted_at) < 3 * WORKERS * GATEWAYS:
            bounded("the team's limit did not refuse after the failover")
            await asyncio.sleep(0.05)
    finally:
        run.stop = True


def _metric(app: GatewayApp, action: str) -> float:
    value = app.metrics.registry.get_sample_value(
        "sarv_gateway_ratelimit_backend_errors_total", {"action": action}
    )
    return value or 0.0


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail-open", "fail-closed"])
async def test_a_killed_primary_over_admits_at_most_the_documented_bound(
    cluster: RedisCluster, tmp_path: Path, fail_open: bool
) -> None:
    store = make_store(tmp_path)
    store.put_team(TeamRecord(name="ml", rpm=TEAM_RPM))
    for name in ("a", "b", "c"):
        add_key(store, name, team="ml", rpm=KEY_RPM)
    apps = _gateways(cluster, store, fail_open)
    run = Run()
    try:
        records = [store.get_api_key_by_name(name) for name in ("a", "b", "c")]
        levels = [await apps[0].admission.levels(r) for r in records if r is not None]
        assert [lv[1].subject for lv in levels] == [SUBJECT] * 3
        begun = time.monotonic()
        await asyncio.gather(
            _conductor(run, cluster, begun),
            *(_worker(run, g, app, levels) for g, app in enumerate(apps) for _ in range(WORKERS)),
        )
    finally:
        for app in apps:
            await app.limiter.close()
        store.close()
    assert run.killed_at is not None and run.promoted_at is not None
    killed_at, promoted_at = run.killed_at, run.promoted_at

    escaped = {o.what for o in run.outcomes} - {"checked", "unchecked", "429", "503"}
    assert not escaped, f"only admissions and the documented refusals: {escaped}"

    # The bound: the limit, what a lag under LAG_S loses of it, one lease per gateway.
    lease = int(TEAM_RPM * LEASE_FRACTION)
    bound = TEAM_RPM * (1 + LAG_S / 60) + GATEWAYS * lease
    checked = run.count("checked")
    assert checked <= bound, f"{checked} admitted by the team's counters; the documented bound is {bound:.0f}"

    # While no primary answered the setting decided, and the metric counted every such admission.
    faults = [o for o in run.outcomes if o.backend]
    assert faults, "the outage was met by some admissions"
    assert {o.what for o in faults} <= ({"checked", "unchecked"} if fail_open else {"503"})
    assert all(o.ended >= killed_at for o in faults), "no backend error before the kill"
    for g, app in enumerate(apps):
        mine = sum(1 for o in faults if o.gateway == g)
        assert _metric(app, "admitted" if fail_open else "refused") == mine
        assert _metric(app, "refused" if fail_open else "admitted") == 0
    # Each gateway checks again from its first answer by the promoted replica on: no fault after it.
    for g in range(GATEWAYS):
        back = min(
            o.ended
            for o in run.outcomes
            if o.gateway == g and o.what == "checked" and o.started >= promoted_at
        )
        late = [o for o in faults if o.gateway == g and o.started >= back]
        assert not late, f"gateway {g}: {len(late)} backend errors after it was checking again"

    print(
        f"fail_open={fail_open}: {checked} checked admissions of {TEAM_RPM} (bound {bound:.0f}); "
        f"{len(faults)} {'admitted unchecked' if fail_open else 'refused (503)'} in the outage; "
        f"replica held back {(run.resumed_at or killed_at) - killed_at:.1f}s, "
        f"promoted {promoted_at - killed_at:.1f}s after the SIGKILL; "
        f"{run.count('checked', after=killed_at)} checked since the kill, of {len(run.outcomes)} admissions"
    )
