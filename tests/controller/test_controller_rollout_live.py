"""Canary rollouts end to end: real ``sim`` replicas on a declared GPU fleet of this host, a real gateway
routing by version weight, and real controller passes (the reconcile loop with a deployer) judging the
canary from the gateway's and the engines' metrics.

A healthy canary is promoted to 100 % (its traffic share matching the weight on the way, the controller
replaced by a fresh one mid-rollout); a canary with an injected error rate, and one whose TTFT regressed,
is rolled back and exactly the old replicas are left. The ready replicas never drop below the deployment's
count.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import pytest
from fixtures.fleets import gpu_fleet
from fixtures.gateway import GatewayStarter, RunningGateway, add_key, wait_for

from controlplane.controller import Deployer
from controlplane.controller.reconcile import ControllerConfig, Reconciler
from controlplane.controller.rollout import start_rollout
from controlplane.controller.rollout_policy import RolloutPolicy
from controlplane.gateway import GatewayConfig
from controlplane.gateway.config import RoutingConfig
from controlplane.spec import DeploymentSpec, EngineKind, ReplicaState, RolloutStatus

_BODY = {"model": "web", "prompt": "hello", "max_tokens": 2}
_PASSES = 300
"""Most controller passes one test runs (each paced by a batch of requests)."""


@pytest.fixture
def stack(sim_deployer: Callable[..., Deployer]) -> Iterator[tuple[Deployer, RunningGateway, httpx.Client]]:
    d = sim_deployer(gpu_fleet(nodes=3, gpus=1))
    d.deploy(DeploymentSpec(name="web", model="sarv-tiny", engine=EngineKind.SIM, replicas=2), timeout=120)
    starter = GatewayStarter()
    try:
        gw = starter(d.store, GatewayConfig(routing=RoutingConfig(discovery_interval_s=0.2)))
        key = add_key(d.store)
        with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
            wait_for(lambda: c.post("/v1/completions", json=_BODY).status_code == 200, timeout=30)
            yield d, gw, c
    finally:
        starter.close()


class ReadyWatch:
    """The fewest ready replicas of ``web`` seen, polled in a thread while the rollout runs (bounded)."""

    def __init__(self, d: Deployer) -> None:
        self.low = 10**6
        self._stop = threading.Event()
        self._d = d
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for _ in range(20_000):
            if self._stop.wait(0.05):
                return
            ready = sum(1 for r in self._d.store.list_replicas("web") if r.state is ReplicaState.READY)
            self.low = min(self.low, ready)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        return self.low

    def __enter__(self) -> ReadyWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()  # also when the rollout fails: the thread must not outlive the test's store


def reconciler(
    d: Deployer, gw: RunningGateway, client: httpx.AsyncClient, policy: RolloutPolicy
) -> Reconciler:
    config = ControllerConfig(
        period_s=0.2, gateway_metrics=[gw.metrics_url], drain_timeout_s=5, rollout=policy
    )
    return Reconciler(store=d.store, client=client, config=config, deployer=d)


def shares(c: httpx.Client, d: Deployer, n: int) -> Counter[str]:
    """``n`` requests through the gateway; the count of each answer's version (canary or stable)."""
    rollout = d.store.get_rollout("web")
    assert rollout is not None
    versions = {r.id: r.version for r in d.store.list_replicas("web")}
    out: Counter[str] = Counter()
    for _ in range(n):
        resp = c.post("/v1/completions", json=_BODY)
        role = (
            "canary"
            if versions.get(resp.headers.get("x-sarv-replica", "")) == rollout.canary_version
            else "stable"
        )
        out[f"{role}:{resp.status_code}"] += 1
    return out


async def drive(
    c: httpx.Client,
    d: Deployer,
    gw: RunningGateway,
    policy: RolloutPolicy,
    until: Callable[[], bool],
    restart_at: int = -1,
) -> None:
    """Controller passes, each after a few requests through the gateway, until ``until()`` (bounded);
    at pass ``restart_at`` the controller is replaced by a fresh one (its memory gone, the store kept)."""
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
        r = reconciler(d, gw, client, policy)
        for n in range(_PASSES):
            if until():
                return
            if n == restart_at:
                r = reconciler(d, gw, client, policy)
            await asyncio.to_thread(lambda: [c.post("/v1/completions", json=_BODY) for _ in range(6)])
            await r.run_once()
    raise AssertionError(f"not reached in {_PASSES} passes: {d.store.get_rollout('web')}")


def status(d: Deployer) -> RolloutStatus | None:
    rollout = d.store.get_rollout("web")
    return rollout.status if rollout is not None else None


def test_a_healthy_canary_takes_its_share_then_is_promoted_to_100_percent(stack) -> None:
    d, gw, c = stack
    stable = d.store.get_deployment("web").spec
    canary = stable.model_copy(update={"engine_args": {"ttft_ms": 31}})
    rollout = start_rollout(d, "web", canary, steps=[25, 100], timeout=120)
    assert rollout.weight == 25
    versions = Counter(r.version for r in d.store.list_replicas("web"))
    assert versions == {rollout.stable_version: 2, rollout.canary_version: 1}

    wait_for(lambda: shares(c, d, 4)["canary:200"] > 0, timeout=30)  # the gateway has seen the canary
    got = shares(c, d, 200)
    assert got["canary:200"] + got["stable:200"] == 200, got
    assert got["canary:200"] == pytest.approx(50, abs=6), got  # 25 % ± 3 points

    # The window is wall time while the passes are paced by requests: 5 s holds the 5 canary requests a
    # step needs even when a loaded machine sends a pass's requests slowly. Both versions answer in about
    # 30 ms, and the quantile of a handful of requests is their slowest one: on a loaded two-core machine
    # one request stalled by the scheduler for 70 ms passed the default slack (0.05 s) and rolled this
    # healthy canary back. The slack here is above any such stall; the TTFT rule itself rolls back a slow
    # canary in the test below.
    policy = RolloutPolicy(window_s=5.0, min_requests=5, ttft_slack_s=1.0)
    with ReadyWatch(d) as watch:
        asyncio.run(drive(c, d, gw, policy, lambda: status(d) is RolloutStatus.SUCCEEDED, restart_at=3))
    low = watch.low

    assert low >= 2, "never fewer ready replicas than the deployment's count"
    record = d.store.get_deployment("web")
    assert record.spec.engine_args == {"ttft_ms": 31} and record.spec.replicas == 2
    left = d.store.list_replicas("web")
    assert [r.version for r in left] == [rollout.canary_version] * 2
    assert all(r.state is ReplicaState.READY for r in left)
    reasons = [e.reason for e in d.store.list_events("web")]
    assert reasons.count("RolloutStarted") == 1 and "RolloutPromoted" in reasons
    assert reasons[-1] == "RolloutSucceeded" or "RolloutSucceeded" in reasons
    done = d.store.get_rollout("web")
    assert done.comparison["canary_requests"] and done.comparison["canary_requests"] >= 5
    assert done.comparison["canary_ttft_p95_s"], "the engines' TTFT reached the judgement"


@pytest.mark.parametrize(
    ("engine_args", "policy", "reason"),
    [
        pytest.param(
            {"failure_rate": 0.7},
            RolloutPolicy(window_s=30.0, min_requests=5, min_errors=2),
            "canary error ratio",
            id="error-rate",
        ),
        # 800 ms against 30 ms: the canary's p95 lands in the 0.75-1 s bucket, far above the stable's
        # p95 × 1.5 + 0.3 s even when a loaded machine slows the stable replicas' answers.
        pytest.param(
            {"ttft_ms": 800},
            RolloutPolicy(window_s=30.0, min_requests=5, ttft_slack_s=0.3),
            "canary TTFT p95",
            id="slow-ttft",
        ),
    ],
)
def test_a_regressed_canary_is_rolled_back_leaving_exactly_the_old_replicas(
    stack, engine_args: dict[str, float], policy: RolloutPolicy, reason: str
) -> None:
    d, gw, c = stack
    before = {(r.id, r.handle["pid"], r.version) for r in d.store.list_replicas("web")}
    stable = d.store.get_deployment("web").spec
    canary = stable.model_copy(update={"engine_args": engine_args})
    # At 10 % the canary runs beside both stable replicas, so a rollback must leave those very processes.
    rollout = start_rollout(d, "web", canary, steps=[10, 100], timeout=120)
    with ReadyWatch(d) as watch:
        asyncio.run(drive(c, d, gw, policy, lambda: status(d) is RolloutStatus.ROLLED_BACK))
    low = watch.low

    assert low >= 2
    after = {(r.id, r.handle["pid"], r.version) for r in d.store.list_replicas("web")}
    assert after == before, "exactly the old replicas, the same processes"
    assert d.store.get_deployment("web").spec == stable
    done = d.store.get_rollout("web")
    assert reason in done.reason, done.reason
    assert done.weight == 0
    events = [e for e in d.store.list_events("web") if e.reason in {"RollingBack", "RolledBack"}]
    assert [e.reason for e in events] == ["RollingBack", "RolledBack"]
    assert events[0].type == "Warning" and events[0].source == "controller"
    assert rollout.canary_version not in {r.version for r in d.store.list_replicas()}
    wait_for(lambda: set(shares(c, d, 4)) == {"stable:200"}, timeout=10)
