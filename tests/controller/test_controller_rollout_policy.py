"""The rollout policy in simulated time (no process, no clock): step replica counts, the window of
counters, and hold / promote / roll back; and the router's choice of version by weight."""

from __future__ import annotations

from collections import Counter

import pytest

from controlplane.controller.rollout_policy import (
    Action,
    RolloutContext,
    RolloutPolicy,
    RolloutState,
    Sample,
    SourceSample,
    decide,
    step_targets,
    windows,
)
from controlplane.engines.metrics import HistogramSample
from controlplane.gateway.config import RoutingConfig, RoutingPolicy
from controlplane.gateway.routing import Router
from controlplane.spec import EngineKind, ReplicaRecord, ReplicaState

_BOUNDS = (0.01, 0.05, 0.1, 0.5, float("inf"))


def ttft(fast: float, slow: float = 0.0, slower: float = 0.0) -> HistogramSample:
    """A cumulative TTFT histogram: ``fast`` requests under 50 ms, ``slow`` under 0.5 s, ``slower`` above."""
    c = (0.0, fast, fast, fast + slow, fast + slow + slower)
    return HistogramSample(_BOUNDS, c, fast * 0.03 + slow * 0.3 + slower * 1.0)


def sample(
    at: float, calls: tuple[float, float], errors: tuple[float, float], **hist: HistogramSample
) -> Sample:
    """Cumulative counters at ``at``: (canary, stable) gateway calls and errors, and TTFT histograms."""
    sources = [
        SourceSample("gw|web-2", True, calls[0], errors[0]),
        SourceSample("gw|web-0", False, calls[1], errors[1]),
    ]
    if "canary" in hist:
        sources.append(SourceSample("web-2", True, ttft=hist["canary"]))
    if "stable" in hist:
        sources.append(SourceSample("web-0", False, ttft=hist["stable"]))
    return Sample(at, tuple(sources))


POLICY = RolloutPolicy(window_s=30, min_requests=10, min_errors=3)


def run(samples: list[Sample], *, policy: RolloutPolicy = POLICY, settled: bool = True, step: int = 0):
    """Feed ``samples`` one pass each; the last pass's decision."""
    state = RolloutState()
    decision = None
    for s in samples:
        ctx = RolloutContext(policy, s.at, step, (10, 50, 100), settled, s)
        decision, state = decide(ctx, state)
    assert decision is not None
    return decision, state


@pytest.mark.parametrize(
    ("replicas", "weight", "targets"),
    [(1, 10, (1, 1)), (1, 100, (1, 0)), (2, 10, (1, 2)), (2, 50, (1, 1)), (3, 50, (2, 2)), (4, 100, (4, 0))],
)
def test_step_targets_add_the_canary_before_the_stable_goes(replicas: int, weight: int, targets) -> None:
    assert step_targets(replicas, weight) == targets
    canary, stable = targets
    assert canary + stable >= replicas, "never fewer replicas than the deployment's count"


def test_the_window_counts_per_source_and_skips_a_source_that_joined() -> None:
    old = sample(0, (10, 100), (0, 1))
    new = Sample(10, (*sample(10, (30, 180), (4, 1)).sources, SourceSample("gw|web-3", True, 500, 500)))
    canary, stable = windows((old, new))
    assert (canary.calls, canary.errors, stable.calls, stable.errors) == (20, 4, 80, 0)
    assert canary.error_ratio == pytest.approx(0.2)


def test_a_canary_with_errors_is_rolled_back_before_its_step_ends() -> None:
    decision, _ = run([sample(0, (0, 0), (0, 0)), sample(5, (20, 180), (8, 1))])
    assert decision.action is Action.ROLLBACK
    assert "canary error ratio 40.0% (8 of 20 calls) > stable 0.6% + 5.0%" in decision.reason
    assert decision.numbers["canary_error_ratio"] == pytest.approx(0.4)


def test_two_errors_are_not_yet_a_reason() -> None:
    decision, _ = run([sample(0, (0, 0), (0, 0)), sample(5, (4, 40), (2, 0))])
    assert decision.action is Action.HOLD


def test_a_slower_canary_is_rolled_back() -> None:
    first = sample(0, (0, 0), (0, 0), canary=ttft(0), stable=ttft(0))
    later = sample(10, (20, 200), (0, 0), canary=ttft(2, 0, 18), stable=ttft(200))
    decision, _ = run([first, later])
    assert decision.action is Action.ROLLBACK
    assert "canary TTFT p95" in decision.reason and "× 1.5 + 0.05 s" in decision.reason


def test_a_healthy_canary_is_promoted_once_the_window_has_passed_with_traffic() -> None:
    passes = [
        sample(t, (2 * t, 18 * t), (0, 0), canary=ttft(2 * t), stable=ttft(18 * t)) for t in range(0, 40, 5)
    ]
    early, _ = run(passes[:4])  # 15 s of 30
    assert early.action is Action.HOLD and "15 s of 30 s" in early.reason
    decision, _ = run(passes)
    assert decision.action is Action.PROMOTE
    assert decision.reason.startswith("canary healthy over 30 s (TTFT p95 ")
    assert decision.numbers["canary_requests"] == pytest.approx(60)


def test_no_traffic_holds_and_an_unsettled_step_holds() -> None:
    idle = [sample(t, (0, 0), (0, 0)) for t in range(0, 40, 5)]
    decision, _ = run(idle)
    assert decision.action is Action.HOLD and "waiting for traffic (0 of 10" in decision.reason
    decision, _ = run(idle, settled=False)
    assert decision.action is Action.HOLD and "waiting for the step's replicas" in decision.reason


def test_without_auto_promote_a_healthy_step_waits_for_the_operator() -> None:
    passes = [sample(t, (2 * t, 18 * t), (0, 0)) for t in range(0, 40, 5)]
    decision, _ = run(passes, policy=POLICY.model_copy(update={"auto_promote": False}))
    assert decision.action is Action.HOLD and "llmctl rollout promote" in decision.reason


def test_at_the_last_step_the_canary_is_compared_with_the_stables_last_window() -> None:
    state = RolloutState()
    before = [sample(t, (t, 10 * t), (0, 0), canary=ttft(t), stable=ttft(10 * t)) for t in range(0, 35, 5)]
    for s in before:
        _, state = decide(RolloutContext(POLICY, s.at, 1, (10, 50, 100), True, s), state)
    # Step 100 %: the stable takes nothing any more; a slow canary is still caught against its baseline.
    t0 = 40
    after = [
        sample(t0 + t, (30 + 10 * t, 300), (0, 0), canary=ttft(30, 0, 10 * t), stable=ttft(300))
        for t in range(4)
    ]
    decision = None
    for s in after:
        decision, state = decide(RolloutContext(POLICY, s.at, 2, (10, 50, 100), True, s), state)
    assert decision is not None and decision.action is Action.ROLLBACK
    assert state.baseline is not None


def _replica(rid: str, version: str) -> ReplicaRecord:
    return ReplicaRecord(
        id=rid,
        deployment="web",
        index=0,
        model="web",
        engine=EngineKind.SIM,
        node="n",
        endpoint=f"http://127.0.0.1:1/{rid}",
        state=ReplicaState.READY,
        version=version,
    )


@pytest.mark.parametrize("weight", [0.1, 0.25, 0.5, 0.9])
def test_the_router_sends_the_canary_its_weight_of_requests(weight: float) -> None:
    router = Router(RoutingConfig(policy=RoutingPolicy.LEAST_LOAD))
    router.set_replicas(
        [_replica("web-0", "old"), _replica("web-1", "old"), _replica("web-2", "new")], {"new": weight}
    )
    picks = Counter(router.pick("web", []).version for _ in range(200))  # type: ignore[union-attr]
    assert picks["new"] == pytest.approx(200 * weight, abs=1)
    # Within the stable version the normal scoring still spreads the load.
    both = Counter(router.pick("web", []).id for _ in range(200))  # type: ignore[union-attr]
    assert both["web-0"] > 0 and both["web-1"] > 0


def test_the_router_uses_the_other_version_when_the_chosen_one_is_excluded() -> None:
    router = Router(RoutingConfig())
    router.set_replicas([_replica("web-0", "old"), _replica("web-2", "new")], {"new": 1.0})
    assert router.pick("web", []).id == "web-2"  # type: ignore[union-attr]
    assert router.pick("web", [], frozenset({"web-2"})).id == "web-0"  # type: ignore[union-attr]
    router.set_replicas([_replica("web-0", "old"), _replica("web-2", "new")])
    assert Counter(router.pick("web", []).id for _ in range(10)) == {"web-0": 5, "web-2": 5}  # type: ignore[union-attr]
