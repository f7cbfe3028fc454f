"""The rollout policy: a pure function from the canary's and the stable version's signals over a window
(TTFT p95, error ratio) to hold, promote or roll back; and the replica counts of each step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from controlplane.engines.metrics import HistogramSample

__all__ = [
    "Action",
    "RolloutContext",
    "RolloutDecision",
    "RolloutPolicy",
    "RolloutState",
    "Sample",
    "SourceSample",
    "VersionWindow",
    "decide",
    "step_targets",
    "windows",
]


class RolloutPolicy(BaseModel):
    """How the controller judges a canary; the ``rollout`` section of the controller's YAML file.

    Errors are the gateways' failed upstream calls over their calls, per replica
    (``sarv_gateway_upstream_errors_total`` / ``sarv_gateway_routing_decisions_total``); TTFT is the
    engines' ``vllm:time_to_first_token_seconds`` histogram, per replica. Both are summed per version.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    window_s: float = Field(default=60.0, gt=0, le=86_400)
    """The comparison window; also the least time each step runs before it is promoted."""
    min_requests: int = Field(default=20, ge=1, le=1_000_000)
    """Canary requests in the window before its TTFT is judged or a step is promoted."""
    ttft_quantile: float = Field(default=0.95, gt=0, lt=1)
    max_ttft_ratio: float = Field(default=1.5, ge=1, le=100)
    """Roll back when the canary's TTFT quantile passes the stable's times this, plus ``ttft_slack_s``."""
    ttft_slack_s: float = Field(default=0.05, ge=0, le=60)
    """Absolute allowance on top of the ratio: a few milliseconds on a fast model are not a regression."""
    max_error_ratio_increase: float = Field(default=0.05, ge=0, le=1)
    """Roll back when the canary's error ratio passes the stable's by more than this (0.05: 5 points)."""
    min_errors: int = Field(default=3, ge=1, le=1_000_000)
    """Canary errors in the window before the error ratio may roll back (one failed call does not)."""
    auto_promote: bool = True
    """Promote healthy steps without an operator; False: hold each step for ``llmctl rollout promote``
    (a rollback stays automatic)."""


class Action(StrEnum):
    HOLD = "hold"
    PROMOTE = "promote"
    """To the next step, or at the last step: the rollout succeeds."""
    ROLLBACK = "rollback"


@dataclass(frozen=True)
class SourceSample:
    """One source's cumulative counters in one pass: a replica's engine (``ttft``), or one gateway's
    view of one replica (``calls``, ``errors``)."""

    source: str
    canary: bool
    calls: float = 0.0
    errors: float = 0.0
    ttft: HistogramSample | None = None


@dataclass(frozen=True)
class Sample:
    at: float
    sources: tuple[SourceSample, ...]


@dataclass(frozen=True)
class VersionWindow:
    """One version's traffic over the window."""

    calls: float = 0.0
    errors: float = 0.0
    ttft: HistogramSample | None = None

    @property
    def requests(self) -> float:
        """Calls the gateways made; where no gateway reports, the requests the engines timed."""
        return max(self.calls, self.ttft.count if self.ttft is not None else 0.0)

    @property
    def error_ratio(self) -> float | None:
        return self.errors / self.calls if self.calls > 0 else None

    def ttft_quantile(self, q: float) -> float | None:
        return self.ttft.quantile(q) if self.ttft is not None else None


@dataclass(frozen=True)
class RolloutState:
    """What the policy remembers between passes; the controller keeps it per rollout (in memory: after a
    restart a step's window and clock start again)."""

    step: int = -1
    """The step the samples belong to: another one starts a new window."""
    step_since: float | None = None
    """When the current step was first seen settled (its replicas in place)."""
    samples: tuple[Sample, ...] = ()
    baseline: VersionWindow | None = None
    """The stable version's last window with enough requests: what the canary is compared with once
    the stable takes too little traffic (the last step sends it none)."""


@dataclass(frozen=True)
class RolloutContext:
    """Everything :func:`decide` may look at: no store, no clock, no HTTP."""

    policy: RolloutPolicy
    now: float
    """Seconds on any monotonic scale."""
    step: int
    steps: tuple[int, ...]
    settled: bool
    """The step's replicas are in place and ready (its share is what the gateways route)."""
    sample: Sample


@dataclass(frozen=True)
class RolloutDecision:
    action: Action
    reason: str
    numbers: dict[str, float | None] = field(default_factory=dict)
    """The comparison: ``canary_requests``, ``canary_error_ratio``, ``canary_ttft_p95_s``, and the
    same for ``stable_`` (None where there is nothing to say)."""


_EPSILON = 1e-9


def step_targets(replicas: int, weight: int) -> tuple[int, int]:
    """``(canary, stable)`` replicas of a deployment of ``replicas`` at a canary share of ``weight`` %.

    The canary gets at least one replica and its share of the count (rounded up); the stable keeps the
    rest of the count plus one while the canary takes part of the traffic (rounded down), so that a step
    adds the canary before it removes a stable replica and the deployment never runs fewer than
    ``replicas``. At 100 % the stable has none left.
    """
    if weight >= 100:
        return replicas, 0
    canary = max(1, math.ceil(replicas * weight / 100 - _EPSILON))
    stable = max(1, replicas - math.floor(replicas * weight / 100 + _EPSILON))
    return canary, stable


def windows(samples: tuple[Sample, ...]) -> tuple[VersionWindow, VersionWindow]:
    """``(canary, stable)`` traffic between the oldest and the newest sample, per source present in both
    (a replica that joined or left in between adds nothing rather than a jump)."""
    if len(samples) < 2:
        return VersionWindow(), VersionWindow()
    oldest = {s.source: s for s in samples[0].sources}
    out = {True: VersionWindow(), False: VersionWindow()}
    for new in samples[-1].sources:
        old = oldest.get(new.source)
        if old is None or old.canary != new.canary:
            continue
        seen = out[new.canary]
        # A counter that went down restarted (an engine, a gateway): everything since counts.
        calls = new.calls - old.calls if new.calls >= old.calls else new.calls
        errors = new.errors - old.errors if new.errors >= old.errors else new.errors
        ttft = seen.ttft
        if new.ttft is not None:
            delta = new.ttft.since(old.ttft) if old.ttft is not None else None
            if delta is not None:
                ttft = delta if ttft is None else ttft.plus(delta)
        out[new.canary] = VersionWindow(seen.calls + calls, seen.errors + errors, ttft)
    return out[True], out[False]


def _numbers(policy: RolloutPolicy, canary: VersionWindow, stable: VersionWindow) -> dict[str, float | None]:
    q = policy.ttft_quantile
    return {
        "canary_requests": canary.requests,
        "canary_errors": canary.errors,
        "canary_error_ratio": canary.error_ratio,
        "canary_ttft_p95_s": canary.ttft_quantile(q),
        "stable_requests": stable.requests,
        "stable_errors": stable.errors,
        "stable_error_ratio": stable.error_ratio,
        "stable_ttft_p95_s": stable.ttft_quantile(q),
    }


def _regression(policy: RolloutPolicy, canary: VersionWindow, stable: VersionWindow) -> str | None:
    """Why the canary is worse than the stable version; None when it is not (or it cannot be told yet)."""
    ratio = canary.error_ratio
    if ratio is not None and canary.errors >= policy.min_errors:
        base = stable.error_ratio or 0.0
        if ratio > base + policy.max_error_ratio_increase + _EPSILON:
            return (
                f"canary error ratio {ratio:.1%} ({canary.errors:.0f} of {canary.calls:.0f} calls) > "
                f"stable {base:.1%} + {policy.max_error_ratio_increase:.1%}"
            )
    q = policy.ttft_quantile
    mine, theirs = canary.ttft_quantile(q), stable.ttft_quantile(q)
    enough = canary.ttft is not None and canary.ttft.count >= policy.min_requests
    if mine is not None and theirs is not None and enough:
        bar = theirs * policy.max_ttft_ratio + policy.ttft_slack_s
        if mine > bar + _EPSILON:
            return (
                f"canary TTFT p{q * 100:g} {mine:.3f} s > stable {theirs:.3f} s × "
                f"{policy.max_ttft_ratio:g} + {policy.ttft_slack_s:g} s"
            )
    return None


def decide(ctx: RolloutContext, state: RolloutState) -> tuple[RolloutDecision, RolloutState]:
    """Judge the canary of one rollout this pass; return the decision and the state for the next.

    Roll back, at any time, when over the window the canary's error ratio passes the stable's by more
    than ``max_error_ratio_increase`` (after ``min_errors``) or its TTFT quantile passes the stable's
    times ``max_ttft_ratio`` plus ``ttft_slack_s`` (after ``min_requests``). Promote once the step has
    been settled for ``window_s``, the canary has served ``min_requests`` in the window and nothing
    regressed. Otherwise hold, saying for what.
    """
    policy = ctx.policy
    if state.step != ctx.step:
        state = RolloutState(step=ctx.step, baseline=state.baseline)
    kept = tuple(s for s in state.samples if ctx.now - s.at <= policy.window_s + _EPSILON)
    samples = (*kept, ctx.sample)
    canary, stable = windows(samples)
    baseline = stable if stable.requests >= policy.min_requests else state.baseline
    compare_with = stable if stable.requests >= policy.min_requests else (baseline or stable)
    since = state.step_since
    if ctx.settled and since is None:
        since = ctx.now
    after = replace(state, samples=samples, step_since=since, baseline=baseline)
    numbers = _numbers(policy, canary, compare_with)
    weight = ctx.steps[ctx.step]

    def hold(reason: str) -> tuple[RolloutDecision, RolloutState]:
        return RolloutDecision(Action.HOLD, reason, numbers), after

    why = _regression(policy, canary, compare_with)
    if why is not None:
        return RolloutDecision(Action.ROLLBACK, why, numbers), after
    if not ctx.settled or since is None:
        return hold(f"step {weight}%: waiting for the step's replicas to be ready")
    ran = ctx.now - since
    if ran + _EPSILON < policy.window_s:
        return hold(f"step {weight}%: {ran:.0f} s of {policy.window_s:.0f} s")
    if canary.requests < policy.min_requests:
        return hold(
            f"step {weight}%: waiting for traffic ({canary.requests:.0f} of {policy.min_requests} canary "
            f"requests in {policy.window_s:.0f} s)"
        )
    healthy = f"canary healthy over {policy.window_s:.0f} s ({_summary(policy, numbers)})"
    if not policy.auto_promote:
        return hold(f"step {weight}%: {healthy}; promote with `llmctl rollout promote`")
    return RolloutDecision(Action.PROMOTE, healthy, numbers), after


def _summary(policy: RolloutPolicy, numbers: dict[str, float | None]) -> str:
    def seconds(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f} s"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.1%}"

    q = f"p{policy.ttft_quantile * 100:g}"
    return (
        f"TTFT {q} {seconds(numbers['canary_ttft_p95_s'])} vs {seconds(numbers['stable_ttft_p95_s'])}, "
        f"errors {ratio(numbers['canary_error_ratio'])} vs {ratio(numbers['stable_error_ratio'])}"
    )
