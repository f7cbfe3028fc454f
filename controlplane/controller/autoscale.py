"""The autoscaling policy: a pure function from observed load to a recommended replica count."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "AutoscaleConfig",
    "AutoscaleContext",
    "Decision",
    "Direction",
    "PolicyState",
    "ReplicaLoad",
    "decide",
]


class AutoscaleConfig(BaseModel):
    """How one deployment scales; the keys of the ``autoscale`` section of the controller's YAML file.

    Defaults follow the reference points in docs/controller.md: Kubernetes' ±10 % tolerance, a short
    upscale delay and a long downscale delay so that a lull between bursts does not drop replicas.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_ongoing_requests: float = Field(default=8.0, gt=0, le=100_000)
    """Waiting + running requests one replica should carry."""
    min_replicas: int | None = Field(default=None, ge=0, le=1024)
    """Lower bound; None means the deployment's ``--replicas`` (no scaling below what was asked)."""
    max_replicas: int | None = Field(default=None, ge=1, le=1024)
    """Upper bound; None means the deployment's ``--replicas`` (no scaling above what was asked)."""
    upscale_delay_s: float = Field(default=30.0, ge=0, le=86_400)
    """How long every period must ask for more replicas before the policy recommends them."""
    downscale_delay_s: float = Field(default=600.0, ge=0, le=86_400)
    """How long every period must ask for fewer replicas before the policy recommends it."""
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    """Load within ``target × (1 ± tolerance)`` per replica changes nothing."""
    scale_to_zero: bool = False
    """Allow ``min_replicas: 0``. Off by default: it only helps where the gateway holds requests while
    a replica starts, which Sarv's gateway does not do yet."""

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

    def bounds(self, requested: int) -> tuple[int, int]:
        """``(min, max)`` with unset bounds taken from the deployment's requested replica count."""
        low = requested if self.min_replicas is None else self.min_replicas
        high = requested if self.max_replicas is None else self.max_replicas
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


class Direction(StrEnum):
    NONE = "none"
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between periods; the controller keeps it per deployment."""

    direction: Direction = Direction.NONE
    """Which way the consecutive periods so far have pointed."""
    since: float | None = None
    """When the current run of consecutive periods started."""
    periods: int = 0
    """How many consecutive periods have pointed in ``direction``."""


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


def decide(ctx: AutoscaleContext, state: PolicyState) -> tuple[Decision, PolicyState]:
    """Recommend a replica count for ``ctx`` and return it with the state for the next period.

    The desired count is ``ceil(load / target)`` clipped to ``max(min, min(max, desired))``. A change is
    recommended only once every period for ``upscale_delay_s`` (``downscale_delay_s``) has pointed the
    same way; a period in the tolerance band, the other way, or at the same count resets the run. Once
    the delay has passed the recommendation stands for as long as the load keeps asking for it.
    """
    early = _before_measuring(ctx, state)
    if early is not None:
        return early
    cfg = ctx.config
    current = len(ctx.replicas)
    loading = sum(1 for r in ctx.replicas if r.loading)
    measured = [r for r in ctx.replicas if not r.loading]
    low, high = ctx.min_replicas, ctx.max_replicas

    load = sum(r.ongoing or 0.0 for r in measured)
    per_replica = load / current
    ratio = per_replica / cfg.target_ongoing_requests
    details = {"per_replica": per_replica, "ratio": ratio}
    if abs(ratio - 1.0) <= cfg.tolerance + _EPSILON:
        reason = f"{per_replica:.2f} requests per replica is within {cfg.tolerance:.0%} of the target"
        return Decision(current, current, reason, current, load, details), PolicyState()

    desired = _clip(math.ceil(load / cfg.target_ongoing_requests - _EPSILON), low, high)
    # Never scale down a replica that is still loading: only measured replicas may go.
    desired = max(desired, loading)
    direction = Direction.UP if desired > current else Direction.DOWN if desired < current else Direction.NONE
    if direction is Direction.NONE:
        reason = f"load {load:g} asks for {desired} replica(s), which is what runs"
        return Decision(current, current, reason, desired, load, details), PolicyState()

    continues = state.direction is direction and state.since is not None
    since = state.since if continues and state.since is not None else ctx.now
    run = PolicyState(direction, since, state.periods + 1 if continues else 1)
    delay = cfg.upscale_delay_s if direction is Direction.UP else cfg.downscale_delay_s
    waited = ctx.now - since
    word = "upscale" if direction is Direction.UP else "downscale"
    if waited >= delay:
        reason = f"load {load:g} asks for {desired} replica(s) for {waited:.0f}s ({run.periods} periods)"
        return Decision(current, desired, reason, desired, load, details), run
    reason = (
        f"{word} to {desired} pending: {waited:.0f}s of {word}_delay_s {delay:.0f}s ({run.periods} periods)"
    )
    return Decision(current, current, reason, desired, load, details), run
