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
        {"target_ongoing_requests": 4, "upscale_delay_s": 0, "downscale_delay_s": 0, **config}
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
    assert state == PolicyState()
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
