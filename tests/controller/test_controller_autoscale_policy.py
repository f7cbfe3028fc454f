"""The pure autoscaling policy: targets, tolerance, clipping, named delays (fake clock), loading replicas."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from pydantic import ValidationError

from controlplane.controller.autoscale import (
    AutoscaleConfig,
    AutoscaleContext,
    Decision,
    Direction,
    PolicyState,
    ReplicaLoad,
    decide,
)
from controlplane.engines.metrics import HistogramSample, parse_histogram


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def loads(*ongoing: float | None, loading: int = 0) -> tuple[ReplicaLoad, ...]:
    ready = [ReplicaLoad(f"d-{i}", ongoing=v) for i, v in enumerate(ongoing)]
    starting = [ReplicaLoad(f"d-{len(ongoing) + i}", loading=True) for i in range(loading)]
    return (*ready, *starting)


def ctx(
    replicas: Sequence[ReplicaLoad],
    now: float,
    *,
    low: int = 1,
    high: int = 10,
    **config: object,
) -> AutoscaleContext:
    cfg = AutoscaleConfig.model_validate(
        {
            "target_ongoing_requests": 4,
            "upscale_delay_s": 0,
            "load_upscale_delay_s": 0,
            "downscale_delay_s": 0,
            "max_step_up": 64,
            "max_step_down": 64,
            "window_s": 1,
            **config,
        }
    )
    return AutoscaleContext("d", cfg, low, high, tuple(replicas), now)


def once(replicas: Sequence[ReplicaLoad], **kw: object) -> Decision:
    decision, _ = decide(ctx(replicas, 0.0, **kw), PolicyState())  # type: ignore[arg-type]
    return decision


# --- target, tolerance, clipping


def test_upscale_to_ceil_of_load_over_target() -> None:
    d = once(loads(10, 10))  # 20 ongoing, target 4 per replica -> 5
    assert (d.current, d.recommended, d.direction) == (2, 5, Direction.UP)
    assert d.load == 20


def test_downscale_to_ceil_of_load_over_target() -> None:
    d = once(loads(1, 1, 1, 0))  # 3 ongoing -> ceil(3/4) = 1
    assert (d.current, d.recommended, d.direction) == (4, 1, Direction.DOWN)


@pytest.mark.parametrize("per_replica", [3.6, 4.0, 4.4])
def test_load_within_ten_percent_of_target_changes_nothing(per_replica: float) -> None:
    d = once(loads(per_replica, per_replica, per_replica))
    assert d.recommended == 3
    assert "within 10%" in d.reason


@pytest.mark.parametrize(("per_replica", "expected"), [(4.5, 4), (3.5, 3)])
def test_load_just_outside_the_band_acts(per_replica: float, expected: int) -> None:
    # 3 × 4.5 = 13.5 -> ceil(13.5/4) = 4; 3 × 3.5 = 10.5 -> ceil = 3 (the same count: nothing to do)
    d = once(loads(per_replica, per_replica, per_replica))
    assert d.recommended == expected


def test_tolerance_is_configurable() -> None:
    d = once(loads(4.6, 4.6, 4.6), tolerance=0.2)
    assert d.recommended == 3


def test_clipped_to_max_replicas() -> None:
    d = once(loads(100, 100), high=3)
    assert (d.recommended, d.desired) == (3, 3)


def test_clipped_to_min_replicas_when_idle() -> None:
    d = once(loads(0, 0, 0, 0), low=2)
    assert d.recommended == 2


def test_below_min_scales_up_at_once_whatever_the_delay() -> None:
    d = once(loads(0), low=3, upscale_delay_s=3600)
    assert (d.current, d.recommended) == (1, 3)
    assert "min_replicas is 3" in d.reason


def test_above_max_scales_down_at_once_whatever_the_delay() -> None:
    d = once(loads(9, 9, 9, 9, 9), high=2, downscale_delay_s=3600)
    assert (d.current, d.recommended) == (5, 2)
    assert "max_replicas is 2" in d.reason


def test_no_replicas_and_min_zero_stays_at_zero() -> None:
    d = once((), low=0, scale_to_zero=True)
    assert (d.current, d.recommended) == (0, 0)


def test_idle_deployment_scales_to_zero_only_when_allowed() -> None:
    assert once(loads(0, 0), low=0, scale_to_zero=True).recommended == 0
    assert once(loads(0, 0), low=1).recommended == 1


# --- config validation and bounds


def test_min_zero_needs_scale_to_zero() -> None:
    with pytest.raises(ValidationError, match="scale_to_zero"):
        AutoscaleConfig(min_replicas=0)
    assert AutoscaleConfig(min_replicas=0, scale_to_zero=True).min_replicas == 0


def test_scale_to_zero_is_off_by_default() -> None:
    assert AutoscaleConfig().scale_to_zero is False


def test_min_above_max_is_refused() -> None:
    with pytest.raises(ValidationError, match="exceeds max_replicas"):
        AutoscaleConfig(min_replicas=5, max_replicas=2)


def test_unset_bounds_are_the_requested_replicas() -> None:
    assert AutoscaleConfig().bounds(3) == (3, 3)
    assert AutoscaleConfig(max_replicas=8).bounds(3) == (3, 8)
    assert AutoscaleConfig(min_replicas=1).bounds(3) == (1, 3)
    # An explicit max below the requested count wins over the implicit min.
    assert AutoscaleConfig(max_replicas=2).bounds(4) == (2, 2)


def test_default_delays_are_asymmetric() -> None:
    cfg = AutoscaleConfig()
    assert cfg.upscale_delay_s < cfg.downscale_delay_s
    assert cfg.tolerance == 0.1


# --- hysteresis with a fake clock


def test_upscale_waits_for_upscale_delay_over_consecutive_periods() -> None:
    clock = FakeClock()
    state = PolicyState()
    seen: list[int] = []
    for _ in range(4):  # periods at t=0, 10, 20, 30
        d, state = decide(ctx(loads(8, 8), clock.now, upscale_delay_s=30), state)
        seen.append(d.recommended)
        clock.advance(10)
    assert seen == [2, 2, 2, 4]
    assert state.direction is Direction.UP
    assert state.periods == 4


def test_pending_upscale_says_how_long_it_waited() -> None:
    clock = FakeClock()
    d, state = decide(ctx(loads(8, 8), clock.now, upscale_delay_s=30), PolicyState())
    d, state = decide(ctx(loads(8, 8), clock.advance(10), upscale_delay_s=30), state)
    assert d.recommended == 2
    assert d.desired == 4
    assert "10s of upscale_delay_s 30s (2 periods)" in d.reason


def test_one_period_in_the_band_resets_the_upscale_run() -> None:
    clock = FakeClock()
    state = PolicyState()
    d, state = decide(ctx(loads(8, 8), clock.now, upscale_delay_s=30), state)
    d, state = decide(ctx(loads(8, 8), clock.advance(20), upscale_delay_s=30), state)
    d, state = decide(ctx(loads(4, 4), clock.advance(10), upscale_delay_s=30), state)  # a dip
    assert (state.direction, state.since, state.periods) == (Direction.NONE, None, 0)
    d, state = decide(ctx(loads(8, 8), clock.advance(10), upscale_delay_s=30), state)
    assert d.recommended == 2  # the run starts again from this period
    d, state = decide(ctx(loads(8, 8), clock.advance(30), upscale_delay_s=30), state)
    assert d.recommended == 4


def test_reversal_restarts_the_run_in_the_new_direction() -> None:
    clock = FakeClock()
    kw: dict[str, object] = {"upscale_delay_s": 30, "downscale_delay_s": 30}
    _, state = decide(ctx(loads(8, 8), clock.now, **kw), PolicyState())  # type: ignore[arg-type]
    _, state = decide(ctx(loads(0, 0), clock.advance(25), **kw), state)  # type: ignore[arg-type]
    assert (state.direction, state.since, state.periods) == (Direction.DOWN, clock.now, 1)


def test_downscale_waits_for_the_longer_downscale_delay() -> None:
    clock = FakeClock()
    state = PolicyState()
    recommended = []
    for _ in range(7):  # t = 0, 100, …, 600
        d, state = decide(ctx(loads(0, 0, 0), clock.now, upscale_delay_s=30, downscale_delay_s=600), state)
        recommended.append(d.recommended)
        clock.advance(100)
    assert recommended == [3, 3, 3, 3, 3, 3, 1]


def test_recommendation_stands_while_the_load_asks_for_it() -> None:
    clock = FakeClock()
    state = PolicyState()
    for _ in range(3):
        d, state = decide(ctx(loads(8, 8), clock.now, upscale_delay_s=10), state)
        clock.advance(10)
    assert d.recommended == 4
    d, state = decide(ctx(loads(8, 8), clock.now, upscale_delay_s=10), state)
    assert d.recommended == 4  # not back to 2 for another delay: the controller may not have acted yet


def test_a_larger_target_in_the_same_direction_keeps_the_run() -> None:
    clock = FakeClock()
    _, state = decide(ctx(loads(8, 8), clock.now, upscale_delay_s=20), PolicyState())
    d, state = decide(ctx(loads(16, 16), clock.advance(20), upscale_delay_s=20), state)
    assert d.recommended == 8


def test_missing_metrics_hold_without_advancing_or_resetting_the_run() -> None:
    clock = FakeClock()
    _, state = decide(ctx(loads(8, 8), clock.now, upscale_delay_s=30), PolicyState())
    d, held = decide(ctx(loads(8, None), clock.advance(10), upscale_delay_s=30), state)
    assert d.recommended == 2
    assert "no load metrics from d-1" in d.reason
    assert held == state


def test_missing_metrics_never_count_as_zero_load() -> None:
    d = once(loads(None, None, None))
    assert d.recommended == 3
    assert d.load is None


# --- loading replicas


def test_loading_replicas_count_as_capacity_on_its_way() -> None:
    # 2 ready carrying 16 want 4 replicas; 2 more are loading: nothing more to add.
    d = once(loads(8, 8, loading=2))
    assert (d.current, d.recommended) == (4, 4)


def test_never_scales_down_a_replica_that_is_still_loading() -> None:
    d = once(loads(0, loading=3))
    assert d.current == 4
    assert d.recommended == 3  # only the measured replica may go
    d = once(loads(0, 0, loading=1))
    assert d.recommended == 1


def test_all_loading_holds() -> None:
    d = once(loads(loading=2))
    assert (d.current, d.recommended) == (2, 2)
    assert "waiting for 2 replica(s) to load" in d.reason


def test_out_of_bounds_never_drops_loading_replicas() -> None:
    d = once(loads(0, loading=3), high=2)
    assert d.recommended == 3


def test_decide_is_pure() -> None:
    c = ctx(loads(8, 8), 5.0, upscale_delay_s=30)
    state = PolicyState(Direction.UP, 0.0, 3)
    assert decide(c, state) == decide(c, state)
    assert state == PolicyState(Direction.UP, 0.0, 3)


# --- queue wait and KV-cache usage over the window

_VLLM_BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, float("inf"))


def histogram(waits: Sequence[float], bounds: tuple[float, ...] = _VLLM_BOUNDS) -> HistogramSample:
    cumulative = tuple(float(sum(1 for w in waits if w <= b)) for b in bounds)
    return HistogramSample(bounds, cumulative, float(sum(waits)))


def queued(replica_id: str, waits: Sequence[float], ongoing: float = 4.0, kv: float = 0.1) -> ReplicaLoad:
    return ReplicaLoad(replica_id, ongoing=ongoing, kv_cache_usage=kv, queue=histogram(waits))


def test_quantile_interpolates_inside_its_bucket() -> None:
    h = histogram([0.4] * 10)  # all in (0.3, 0.5]
    assert h.quantile(0.9) == pytest.approx(0.3 + 0.2 * 0.9)
    assert histogram([]).quantile(0.9) is None


def test_quantile_in_the_first_bucket_is_the_mean_not_an_interpolation() -> None:
    # Idle queues: every wait a few ms. Interpolating in [0, 0.3] would say 0.27 s > 0.2 s.
    h = histogram([0.001] * 50)
    assert h.quantile(0.9) == pytest.approx(0.001)


def test_since_is_the_difference_and_everything_after_a_counter_restart() -> None:
    old, new = histogram([0.1, 0.4]), histogram([0.1, 0.4, 0.9, 0.9])
    delta = new.since(old)
    assert delta.cumulative == histogram([0.9, 0.9]).cumulative
    assert delta.sum == pytest.approx(1.8)
    assert old.since(new) == old  # the engine restarted: its counters began again


def test_parse_histogram_sums_series_and_filters_by_label() -> None:
    text = (
        'sarv_gateway_queue_seconds_bucket{model="a",le="0.1"} 3.0\n'
        'sarv_gateway_queue_seconds_bucket{model="a",le="+Inf"} 4.0\n'
        'sarv_gateway_queue_seconds_sum{model="a"} 0.9\n'
        'sarv_gateway_queue_seconds_bucket{model="b",le="0.1"} 7.0\n'
        'sarv_gateway_queue_seconds_bucket{model="b",le="+Inf"} 7.0\n'
        'sarv_gateway_queue_seconds_count{model="a"} 4.0\n'
    )
    h = parse_histogram(text, "sarv_gateway_queue_seconds", {"model": "a"})
    assert h == HistogramSample((0.1, float("inf")), (3.0, 4.0), 0.9)
    assert parse_histogram(text, "sarv_gateway_queue_seconds", {"model": "c"}) is None


def _queue_run(waits_per_period: Sequence[Sequence[float]], **config: object) -> list[Decision]:
    """Two replicas; each period each of them dequeues the given waits (on top of what came before)."""
    clock = FakeClock()
    state = PolicyState()
    seen: list[float] = []
    out = []
    for waits in waits_per_period:
        seen.extend(waits)
        replicas = (queued("d-0", seen), queued("d-1", seen))
        d, state = decide(ctx(replicas, clock.now, **{"window_s": 30, **config}), state)  # type: ignore[arg-type]
        out.append(d)
        clock.advance(5)
    return out


def test_queue_wait_over_the_target_scales_up_although_requests_per_replica_are_on_target() -> None:
    decisions = _queue_run([[0.01] * 10, [0.01] * 10, [0.6] * 10], max_step_up=1)
    assert [d.recommended for d in decisions] == [2, 2, 3]
    assert decisions[-1].reason.startswith("queue wait p90 0.")
    assert decisions[-1].reason.endswith("s > 0.20 s")


def test_the_further_over_the_target_the_larger_the_step() -> None:
    # p90 about 0.46 s, 2.3 × the target: 2 replicas become ceil(2 × 2.3) = 5, bounded by max_step_up.
    decisions = _queue_run([[0.01] * 10, [0.45] * 10], max_step_up=8)
    assert decisions[-1].recommended == 5
    assert _queue_run([[0.01] * 10, [0.45] * 10], max_step_up=2)[-1].recommended == 4


def test_short_queue_waits_change_nothing() -> None:
    decisions = _queue_run([[0.01] * 10] * 5)
    assert {d.recommended for d in decisions} == {2}


def test_waits_that_left_the_window_no_longer_count() -> None:
    # A burst of long waits, then 40 s of short ones: the 30 s window has forgotten the burst.
    decisions = _queue_run([[0.01] * 10, [0.9] * 10, *[[0.01] * 10] * 8], max_replicas=2)
    assert decisions[1].signals.queue_wait_s is not None
    assert decisions[1].signals.queue_wait_s > 0.2
    last = decisions[-1].signals.queue_wait_s
    assert last is not None
    assert last < 0.2


def test_gateway_queue_wait_scales_up_too() -> None:
    clock = FakeClock()
    bounds = (0.1, 0.25, 0.5, float("inf"))
    replicas = (queued("d-0", []), queued("d-1", []))
    first = (("gw", histogram([0.01] * 5, bounds)),)
    later = (("gw", histogram([0.01] * 5 + [0.4] * 20, bounds)),)
    cfg = {"target_ongoing_requests": 4, "upscale_delay_s": 0, "max_step_up": 1}
    c0 = AutoscaleContext("d", AutoscaleConfig.model_validate(cfg), 1, 5, replicas, clock.now, first)
    _, state = decide(c0, PolicyState())
    c1 = AutoscaleContext("d", c0.config, 1, 5, replicas, clock.advance(5), later)
    d, _ = decide(c1, state)
    assert d.recommended == 3
    assert d.reason.startswith("gateway queue wait p90")


def test_kv_cache_must_stay_high_for_its_window() -> None:
    clock = FakeClock()
    state = PolicyState()
    out = []
    for kv in (0.95, 0.95, 0.95, 0.5, 0.95, 0.95, 0.95):
        replicas = (queued("d-0", [], kv=kv), queued("d-1", [], kv=kv))
        d, state = decide(ctx(replicas, clock.now, kv_cache_window_s=10), state)
        out.append(d.recommended)
        clock.advance(5)
    assert out == [2, 2, 3, 2, 2, 2, 3]


def test_one_decision_adds_at_most_max_step_up() -> None:
    d = once(loads(40, 40), max_step_up=2)
    assert (d.current, d.recommended) == (2, 4)


def test_one_decision_removes_at_most_max_step_down() -> None:
    d = once(loads(0, 0, 0, 0, 0), max_step_down=1)
    assert (d.current, d.recommended) == (5, 4)


def test_queue_pressure_waits_for_replicas_still_loading() -> None:
    clock = FakeClock()
    state = PolicyState()
    seen: list[float] = []
    for waits in ([0.01] * 10, [0.9] * 10):
        seen.extend(waits)
        replicas = (queued("d-0", seen), queued("d-1", seen), ReplicaLoad("d-2", loading=True))
        d, state = decide(ctx(replicas, clock.now, window_s=30), state)
        clock.advance(5)
    assert (d.current, d.recommended) == (3, 3)
    assert "loading are capacity on its way" in d.reason


def test_a_new_measured_replica_starts_a_new_window() -> None:
    clock = FakeClock()
    seen = [0.01] * 10
    _, state = decide(ctx((queued("d-0", seen),), clock.now), PolicyState())
    seen = seen + [0.9] * 10
    d, state = decide(ctx((queued("d-0", seen), queued("d-1", [])), clock.advance(5)), state)
    # The long waits were before d-1 joined: the window restarted, nothing to compare with yet.
    assert d.signals.queue_wait_s is None
    assert len(state.samples) == 1


def test_deployment_bounds_win_over_the_policy_and_the_requested_count() -> None:
    cfg = AutoscaleConfig(min_replicas=1, max_replicas=4)
    assert cfg.bounds(2, 2, 8) == (2, 8)
    assert cfg.bounds(2, None, 8) == (1, 8)
    assert AutoscaleConfig().bounds(3, None, 6) == (3, 6)


def test_request_count_alone_waits_for_load_upscale_delay_but_queue_wait_does_not() -> None:
    clock = FakeClock()
    d, state = decide(ctx(loads(8, 8), clock.now, load_upscale_delay_s=30), PolicyState())
    assert d.recommended == 2
    assert "upscale to 4 pending" in d.reason
    d, _ = decide(ctx(loads(8, 8), clock.advance(30), load_upscale_delay_s=30), state)
    assert d.recommended == 4
    waits = _queue_run([[0.01] * 10, [0.6] * 10], load_upscale_delay_s=600, max_step_up=1)
    assert waits[-1].recommended == 3


def test_scales_down_only_to_a_count_below_the_band() -> None:
    # 3 replicas carrying 7.5 in all (target 4, band 3.6-4.4): 2 replicas would carry 3.75 each, inside
    # the band's top half; the next burst would ask for the third back. Stays at 3 until the load falls.
    assert once(loads(2.5, 2.5, 2.5)).recommended == 3
    assert once(loads(2.0, 2.0, 2.0)).recommended == 2


def test_a_one_period_burst_is_averaged_over_the_window() -> None:
    clock = FakeClock()
    state = PolicyState()
    for ongoing in (4, 4, 4, 4, 4):
        _, state = decide(ctx(loads(ongoing, ongoing), clock.now, window_s=30), state)
        clock.advance(5)
    d, _ = decide(ctx(loads(6, 6), clock.now, window_s=30), state)
    assert d.recommended == 2  # 6 per replica this period, 4.33 over the window: inside the band
    assert d.signals.load == pytest.approx((5 * 8 + 12) / 6)
