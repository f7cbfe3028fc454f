"""The autoscaling policy: a pure function from observed load (queue wait, KV-cache usage, requests per
replica) and its window to a recommended replica count."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from controlplane.engines.metrics import HistogramSample

__all__ = [
    "AutoscaleConfig",
    "AutoscaleContext",
    "Decision",
    "Direction",
    "PolicyState",
    "ReplicaLoad",
    "Sample",
    "Signals",
    "decide",
]


class AutoscaleConfig(BaseModel):
    """How one deployment scales; the keys of the ``autoscale`` section of the controller's YAML file.

    Queue wait and KV-cache usage say when a deployment needs more replicas; load per replica says how
    many it needs and when it has too many. The delays and the window are chosen in docs/controller.md
    and measured in bench/controller/autoscale_reaction.py.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_wait_target_s: float = Field(default=0.2, gt=0, le=3600)
    """Scale up when the window's ``queue_wait_quantile`` of the replicas' queue time (vLLM's
    ``vllm:request_queue_time_seconds``) or of the gateway's (``sarv_gateway_queue_seconds``) passes it."""
    queue_wait_quantile: float = Field(default=0.9, gt=0, lt=1)
    window_s: float = Field(default=30.0, gt=0, le=3600)
    """The window of the queue-wait quantile and of the mean requests per replica."""
    kv_cache_target: float = Field(default=0.9, gt=0, le=1)
    """Scale up when the replicas' mean KV-cache usage stays above it for ``kv_cache_window_s``."""
    kv_cache_window_s: float = Field(default=30.0, ge=0, le=3600)
    target_ongoing_requests: float = Field(default=8.0, gt=0, le=100_000)
    """Waiting + running requests one replica should carry: the size asked for, and the bar below which
    (less ``tolerance``) a replica is idle enough to go."""
    min_replicas: int | None = Field(default=None, ge=0, le=1024)
    """Lower bound when the deployment has none (``llmctl deploy --min-replicas``); None means its
    ``--replicas`` (no scaling below what was asked)."""
    max_replicas: int | None = Field(default=None, ge=1, le=1024)
    """Upper bound when the deployment has none; None means its ``--replicas``."""
    upscale_delay_s: float = Field(default=0.0, ge=0, le=86_400)
    """How long every period must ask for more replicas before the policy recommends them. 0: the
    windowed quantile is already the smoothing, and a second delay would only add reaction time."""
    load_upscale_delay_s: float = Field(default=30.0, ge=0, le=86_400)
    """The delay of a scale-up asked for by the request count alone (no queue wait, no KV pressure): a
    count is noisier than a wait and says less about what users see."""
    downscale_delay_s: float = Field(default=300.0, ge=0, le=86_400)
    """The stabilisation window: how long every period must ask for fewer replicas before they go."""
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    """Load within ``target × (1 ± tolerance)`` per replica changes nothing."""
    max_step_up: int = Field(default=2, ge=1, le=64)
    """Most replicas one decision adds."""
    max_step_down: int = Field(default=2, ge=1, le=64)
    """Most replicas one decision removes."""
    scale_to_zero: bool = False
    """Take a deployment whose spec does not say (``scale_to_zero`` unset) to zero after
    ``idle_timeout_s`` without a request (controller/idle.py); also allows ``min_replicas: 0``, which the
    controller reads as 1: below one replica is the idle path's, never a load decision's."""
    idle_timeout_s: float = Field(default=300.0, ge=1, le=7 * 86_400)
    """Seconds without a request before a scale-to-zero deployment goes to zero (its spec's wins)."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min_replicas == 0 and not self.scale_to_zero:
            raise ValueError("min_replicas 0 needs scale_to_zero: true")
        if (
            self.min_replicas is not None
            and self.max_replicas is not None
            and self.min_replicas > self.max_replicas
        ):
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self

    def bounds(
        self, requested: int, min_replicas: int | None = None, max_replicas: int | None = None
    ) -> tuple[int, int]:
        """``(min, max)``: the deployment's own bounds (``min_replicas``/``max_replicas`` of its spec), else
        this policy's, else the deployment's requested replica count."""
        low = next((b for b in (min_replicas, self.min_replicas) if b is not None), requested)
        high = next((b for b in (max_replicas, self.max_replicas) if b is not None), requested)
        # An explicit bound on one side and the default on the other may cross (max 2, --replicas 4).
        return min(low, high), high


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the policy sees it."""

    replica_id: str
    loading: bool = False
    """Started but not ready yet: it counts as capacity on its way and is never scaled down."""
    ongoing: float | None = None
    """Waiting + running requests; None when its metrics could not be read this period."""
    kv_cache_usage: float | None = None
    """Fraction (0..1) of its KV cache in use; None when not reported."""
    queue: HistogramSample | None = None
    """Its queue-time histogram as scraped (cumulative since the engine started)."""


@dataclass(frozen=True)
class AutoscaleContext:
    """Everything :func:`decide` may look at: no store, no clock, no HTTP."""

    deployment: str
    config: AutoscaleConfig
    min_replicas: int
    max_replicas: int
    replicas: tuple[ReplicaLoad, ...]
    now: float
    """Seconds on any monotonic scale (the controller's clock; a fake one in tests)."""
    gateway_queue: tuple[tuple[str, HistogramSample], ...] = ()
    """The gateways' queue-time histograms of this deployment's model, by gateway."""


class Direction(StrEnum):
    NONE = "none"
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True)
class Sample:
    """The histograms of one period, kept for the window: by source (a replica id, ``gateway:URL``)."""

    at: float
    queues: tuple[tuple[str, HistogramSample], ...]
    load: float = 0.0
    """Waiting + running requests over the measured replicas."""


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between periods; the controller keeps it per deployment."""

    direction: Direction = Direction.NONE
    """Which way the consecutive periods so far have pointed."""
    since: float | None = None
    """When the current run of consecutive periods started."""
    periods: int = 0
    """How many consecutive periods have pointed in ``direction``."""
    samples: tuple[Sample, ...] = ()
    """The queue histograms of the periods within the window, oldest first."""
    kv_high_since: float | None = None
    """Since when the mean KV-cache usage has been above the target without a break."""
    members: frozenset[str] = frozenset()
    """The measured replicas the samples are of: a change (one joined, one left) starts a new window, so
    waits from before a scale-up do not ask for another one."""


@dataclass(frozen=True)
class Signals:
    """What the window says, for the reason, the metrics and the benchmark."""

    queue_wait_s: float | None = None
    """The larger of the replicas' and the gateways' queue-wait quantile over the window."""
    queue_source: str = ""
    """``replicas`` or ``gateway``: which of the two ``queue_wait_s`` is."""
    kv_cache_usage: float | None = None
    """Mean KV-cache usage of the measured replicas this period."""
    kv_high_for_s: float = 0.0
    load: float = 0.0
    """Mean waiting + running requests over the window (the measured replicas together)."""


@dataclass(frozen=True)
class Decision:
    current: int
    """Replicas that exist now (ready, unhealthy and loading)."""
    recommended: int
    """Replicas the deployment should have; equal to ``current`` when nothing is to be done."""
    reason: str
    desired: int | None = None
    """The clipped count the load asks for, even while a delay holds it back (None: not computed)."""
    load: float | None = None
    """Total waiting + running requests over the measured replicas (None: not measured)."""
    details: dict[str, float] = field(default_factory=dict)
    signals: Signals = Signals()

    @property
    def direction(self) -> Direction:
        if self.recommended > self.current:
            return Direction.UP
        if self.recommended < self.current:
            return Direction.DOWN
        return Direction.NONE


# Float sums of gauges land a hair off exact values (3 × 4.4 / 12 = 1.1000000000000003): without this,
# a load exactly on the tolerance edge or on a multiple of the target would tip the count by one.
_EPSILON = 1e-9


def _clip(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _before_measuring(ctx: AutoscaleContext, state: PolicyState) -> tuple[Decision, PolicyState] | None:
    """The answer when load cannot or need not be weighed: out of bounds, metrics missing, all loading."""
    current = len(ctx.replicas)
    loading = sum(1 for r in ctx.replicas if r.loading)
    low, high = ctx.min_replicas, ctx.max_replicas
    # Outside the bounds (the bounds changed, or a replica was added by hand): back inside at once, no delay.
    if current < low or current > high:
        target = max(_clip(current, low, high), loading)
        bound = f"min_replicas is {low}" if current < low else f"max_replicas is {high}"
        return Decision(current, target, f"{current} replica(s) but {bound}", target), PolicyState()
    unknown = sorted(r.replica_id for r in ctx.replicas if not r.loading and r.ongoing is None)
    if unknown:
        # A missing metric is not zero load (treating it so is how autoscalers "never scale down" or
        # collapse a busy deployment): hold, and keep the run so far without extending it.
        return Decision(current, current, f"no load metrics from {', '.join(unknown)}"), state
    if loading == current:
        why = f"waiting for {loading} replica(s) to load" if loading else "no replicas to measure"
        return Decision(current, current, why), PolicyState()
    return None


def _window(ctx: AutoscaleContext, state: PolicyState) -> tuple[Signals, PolicyState]:
    """Add this period's histograms to the window and read the signals off it."""
    cfg = ctx.config
    measured = [r for r in ctx.replicas if not r.loading]
    members = frozenset(r.replica_id for r in measured)
    queues = tuple(
        [(r.replica_id, r.queue) for r in measured if r.queue is not None]
        + [(f"gateway:{name}", h) for name, h in ctx.gateway_queue]
    )
    kept = state.samples if members == state.members else ()
    kept = tuple(s for s in kept if ctx.now - s.at <= cfg.window_s + _EPSILON)
    load = sum(r.ongoing or 0.0 for r in measured)
    samples = (*kept, Sample(ctx.now, queues, load))
    mean_load = sum(s.load for s in samples) / len(samples)

    oldest = dict(samples[0].queues)
    recent: dict[str, HistogramSample | None] = {"replicas": None, "gateway": None}
    if len(samples) > 1:
        for source, histogram in queues:
            before = oldest.get(source)
            if before is None:
                continue
            part = "gateway" if source.startswith("gateway:") else "replicas"
            delta = histogram.since(before)
            seen = recent[part]
            recent[part] = delta if seen is None else seen.plus(delta)
    wait: float | None = None
    which = ""
    for part, windowed in recent.items():
        value = windowed.quantile(cfg.queue_wait_quantile) if windowed is not None else None
        if value is not None and (wait is None or value > wait):
            wait, which = value, part

    usages = [r.kv_cache_usage for r in measured if r.kv_cache_usage is not None]
    kv = sum(usages) / len(usages) if usages else None
    high = kv is not None and kv > cfg.kv_cache_target
    kv_since = (state.kv_high_since if state.kv_high_since is not None else ctx.now) if high else None
    signals = Signals(wait, which, kv, ctx.now - kv_since if kv_since is not None else 0.0, mean_load)
    after = PolicyState(state.direction, state.since, state.periods, samples, kv_since, members)
    return signals, after


def _pressure(cfg: AutoscaleConfig, signals: Signals) -> str | None:
    """Why the deployment needs more replicas whatever its request count; None when it does not."""
    if signals.queue_wait_s is not None and signals.queue_wait_s > cfg.queue_wait_target_s:
        where = "gateway queue" if signals.queue_source == "gateway" else "queue"
        return (
            f"{where} wait p{cfg.queue_wait_quantile * 100:g} {signals.queue_wait_s:.2f} s "
            f"> {cfg.queue_wait_target_s:.2f} s"
        )
    kv = signals.kv_cache_usage
    if kv is not None and kv > cfg.kv_cache_target and signals.kv_high_for_s >= cfg.kv_cache_window_s:
        return f"KV cache {kv:.0%} > {cfg.kv_cache_target:.0%} for {signals.kv_high_for_s:.0f} s"
    return None


def decide(ctx: AutoscaleContext, state: PolicyState) -> tuple[Decision, PolicyState]:
    """Recommend a replica count for ``ctx`` and return it with the state for the next period.

    Up: when the window's queue-wait quantile passes ``queue_wait_target_s``, the mean KV-cache usage has
    stayed above ``kv_cache_target`` for ``kv_cache_window_s``, or the load per replica is above
    ``target_ongoing_requests`` (beyond the tolerance): to ``ceil(load / target)``, at least one more,
    at most ``max_step_up`` more. Not while a replica is still loading: it is capacity on its way, and
    the queue it has not started to drain would ask again for what it brings.

    Down: when the load per replica is below the target (beyond the tolerance) and neither queue wait
    nor KV usage presses: to ``ceil(load / target)``, at most ``max_step_down`` fewer, never below the
    replicas still loading.

    Everything is clipped to ``[min_replicas, max_replicas]``. A change is recommended only once every
    period for ``upscale_delay_s`` (``downscale_delay_s``) has pointed the same way; a period in the
    tolerance band, the other way, or at the same count resets the run.
    """
    early = _before_measuring(ctx, state)
    if early is not None:
        return early
    cfg = ctx.config
    signals, state = _window(ctx, state)
    current = len(ctx.replicas)
    loading = sum(1 for r in ctx.replicas if r.loading)
    low, high = ctx.min_replicas, ctx.max_replicas

    # Sized on the window's mean, not one period's count: a passing burst is not a reason to add.
    load = signals.load
    per_replica = load / current
    ratio = per_replica / cfg.target_ongoing_requests
    details = {"per_replica": per_replica, "ratio": ratio}
    if signals.queue_wait_s is not None:
        details["queue_wait_s"] = signals.queue_wait_s
    if signals.kv_cache_usage is not None:
        details["kv_cache_usage"] = signals.kv_cache_usage
    by_load = math.ceil(load / cfg.target_ongoing_requests - _EPSILON)

    def hold(reason: str, desired: int | None = None) -> tuple[Decision, PolicyState]:
        rest = PolicyState(samples=state.samples, kv_high_since=state.kv_high_since, members=state.members)
        return Decision(current, current, reason, desired, load, details, signals), rest

    pressure = _pressure(cfg, signals)
    in_band = abs(ratio - 1.0) <= cfg.tolerance + _EPSILON

    if pressure is not None or (ratio > 1.0 and not in_band):
        if loading:
            why = pressure or f"{per_replica:.2f} requests per replica"
            return hold(f"{why}; {loading} replica(s) loading are capacity on its way", current)
        wanted = by_load
        if pressure is not None:
            # As far over the target as the wait is, at least one more (then the step bound).
            wait = signals.queue_wait_s or 0.0
            over = max(1.0, wait / cfg.queue_wait_target_s) if "queue" in pressure else 1.0
            wanted = max(by_load, current + 1, math.ceil(current * over - _EPSILON))
        desired = _clip(min(wanted, current + cfg.max_step_up), low, high)
        why = pressure or f"{per_replica:.2f} requests per replica > target {cfg.target_ongoing_requests:g}"
    elif in_band:
        return hold(f"{per_replica:.2f} requests per replica is within {cfg.tolerance:.0%} of the target")
    else:
        # Down only to a count whose load per replica stays below the band (not just inside its top):
        # otherwise the first burst after a scale-down asks for the replica back.
        floor = cfg.target_ongoing_requests * (1.0 - cfg.tolerance)
        after = math.ceil(load / floor - _EPSILON)
        desired = _clip(max(after, current - cfg.max_step_down), low, high)
        why = f"{per_replica:.2f} requests per replica < target {cfg.target_ongoing_requests:g}"
    # Never scale down a replica that is still loading: only measured replicas may go.
    desired = max(desired, loading)
    direction = Direction.UP if desired > current else Direction.DOWN if desired < current else Direction.NONE
    if direction is Direction.NONE:
        bound = " (a bound)" if desired in {low, high} else ""
        return hold(f"{why}, but {desired} replica(s){bound} is what runs", desired)

    delay = cfg.downscale_delay_s
    if direction is Direction.UP:
        delay = (
            cfg.upscale_delay_s
            if pressure is not None
            else max(cfg.upscale_delay_s, cfg.load_upscale_delay_s)
        )
    base = Decision(current, desired, why, desired, load, details, signals)
    return _after_delay(ctx, state, base, direction, delay)


def _after_delay(
    ctx: AutoscaleContext, state: PolicyState, base: Decision, direction: Direction, delay: float
) -> tuple[Decision, PolicyState]:
    """``base`` once the run in ``direction`` has lasted ``delay``; until then the count as it is."""
    continues = state.direction is direction and state.since is not None
    since = state.since if continues and state.since is not None else ctx.now
    run = PolicyState(
        direction,
        since,
        state.periods + 1 if continues else 1,
        state.samples,
        state.kv_high_since,
        state.members,
    )
    waited = ctx.now - since
    if waited >= delay:
        return base, run
    word = "upscale" if direction is Direction.UP else "downscale"
    reason = (
        f"{word} to {base.recommended} pending ({base.reason}): {waited:.0f}s of {word}_delay_s {delay:.0f}s "
        f"({run.periods} periods)"
    )
    return replace(base, recommended=base.current, reason=reason), run
