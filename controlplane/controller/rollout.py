"""Canary rollouts (``llmctl rollout``, or a changed spec through ``llmctl apply``): the new version
starts beside the old one as canary replicas, takes a growing share of the traffic step by step, and
replaces the old replicas one by one; or it is rolled back and exactly the old version is left.

The :class:`~controlplane.spec.RolloutRecord` in the state store is the whole truth of a rollout (its
specs, step and status), and every replica record carries its version, so the replica changes a step
needs are derived from the store on every call (:func:`converge`): a controller restarted mid-rollout
goes on where the last one stopped. The gateways route by the record's weight between the versions.
While a rollout is active the deployment's spec stays the stable one; the canary's becomes the spec
only when the rollout succeeds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from controlplane.controller.deploy import LEAVING_STATES, Deployer, check_sources
from controlplane.controller.events import record_event
from controlplane.controller.rollout_policy import (
    Action,
    RolloutContext,
    RolloutDecision,
    RolloutPolicy,
    RolloutState,
    Sample,
    SourceSample,
    decide,
    step_targets,
)
from controlplane.controller.scaling import drain_replicas
from controlplane.engines.base import check_engine_args
from controlplane.engines.metrics import HistogramSample, parse_counters
from controlplane.errors import (
    LaunchError,
    NotFoundError,
    PlacementError,
    UserError,
    describe_validation_error,
)
from controlplane.spec import (
    IN_PLACE_FIELDS,
    DeploymentRecord,
    DeploymentSpec,
    ReplicaRecord,
    ReplicaState,
    RolloutRecord,
    RolloutStatus,
    spec_version,
)

if TYPE_CHECKING:
    from controlplane.controller.reconcile import ControllerMetrics

__all__ = [
    "ROLLOUT_REASONS",
    "abort",
    "apply_sets",
    "converge",
    "drive",
    "get_rollout",
    "promote",
    "sample_of",
    "start_rollout",
]

logger = logging.getLogger(__name__)

ROLLOUT_REASONS = ("RolloutStarted", "RolloutPromoted", "RolloutSucceeded", "RollingBack", "RolledBack")
"""Reasons of the events a rollout records."""

_NOT_SET = {
    "name": "a deployment keeps its name",
    "model": "another model is another deployment: `llmctl deploy` it under a new name",
    "replicas": "the replica count changes with `llmctl scale`",
    "min_replicas": "replica bounds change with `llmctl apply` or `llmctl scale`",
    "max_replicas": "replica bounds change with `llmctl apply` or `llmctl scale`",
    "scale_to_zero": "scaling to zero changes in place with `llmctl apply` or `llmctl deploy`",
    "idle_timeout_s": "scaling to zero changes in place with `llmctl apply` or `llmctl deploy`",
}
"""Fields ``--set`` refuses, with what to do instead."""

_CALLS = "sarv_gateway_routing_decisions_total"
_ERRORS = "sarv_gateway_upstream_errors_total"


# --- input


def _scalar(text: str) -> Any:
    """``8`` → 8, ``true`` → True, ``0.5`` → 0.5, anything else the text itself (YAML's scalars)."""
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if isinstance(value, str | int | float | bool) else text


def apply_sets(spec: DeploymentSpec, sets: list[str]) -> DeploymentSpec:
    """``spec`` with each ``KEY=VALUE`` of ``sets`` applied: a field of the spec (``source``,
    ``max_model_len``, ``tools`` …), ``engine_args.NAME`` or ``sources.VARIANT``; a one-line error names
    the first unknown key or bad value."""
    if not sets:
        raise UserError("nothing to roll out", hint="give at least one --set KEY=VALUE")
    data = spec.model_dump(mode="json")
    fields = set(DeploymentSpec.model_fields)
    for item in sets:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise UserError(
                f"--set {item!r} must be KEY=VALUE", hint="e.g. --set engine_args.max_num_seqs=64"
            )
        head, dot, sub = key.partition(".")
        if head in _NOT_SET:
            raise UserError(f"--set {key}: {_NOT_SET[head]}")
        if head not in fields or (dot and head not in {"engine_args", "sources"}) or (dot and not sub):
            known = ", ".join(sorted(fields - set(_NOT_SET)))
            raise UserError(
                f"--set {key}: not a deployment field",
                hint=f"use engine_args.NAME, sources.VARIANT or one of: {known}",
            )
        if dot:
            data[head] = {**data.get(head, {}), sub: _scalar(raw) if head == "engine_args" else raw}
        else:
            data[head] = None if raw.strip() in {"", "null", "none"} else _scalar(raw)
    try:
        return DeploymentSpec.model_validate(data)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, what=f"--set for {spec.name}")) from None


def get_rollout(deployer: Deployer, name: str, *, active: bool = True) -> RolloutRecord:
    """The rollout of deployment ``name``; a one-line error when it has none (or none active)."""
    if deployer.store.get_deployment(name) is None:
        known = ", ".join(d.name for d in deployer.store.list_deployments()) or "none"
        raise NotFoundError(f"no deployment named {name!r} (deployments: {known})")
    rollout = deployer.store.get_rollout(name)
    if rollout is None or (active and not rollout.active):
        last = f" (the last one {rollout.status.value})" if rollout is not None else ""
        raise UserError(
            f"deployment {name} has no rollout in progress{last}",
            hint=f"start one with `llmctl rollout {name} --set KEY=VALUE`",
        )
    return rollout


# --- actions


def _event(
    deployer: Deployer,
    rollout: RolloutRecord,
    reason: str,
    message: str,
    *,
    source: str,
    metrics: ControllerMetrics | None,
    warning: bool = False,
) -> None:
    record_event(
        deployer.store,
        reason,
        message,
        deployment=rollout.deployment,
        type="Warning" if warning else "Normal",
        source=source,
        metrics=metrics,
        clock=deployer.clock,
    )


def _save(deployer: Deployer, rollout: RolloutRecord, **changes: Any) -> RolloutRecord:
    new = rollout.model_copy(update={**changes, "updated_at": deployer.clock()})
    deployer.store.put_rollout(new)
    return new


def start_rollout(
    deployer: Deployer,
    name: str,
    canary: DeploymentSpec,
    *,
    steps: list[int] | None = None,
    source: str = "llmctl",
    wait: bool = True,
    timeout: float = 600.0,
    drain_timeout: float = 120.0,
) -> RolloutRecord:
    """Record a rollout of deployment ``name`` to ``canary`` and start its first step's canary replicas
    (awaited when ``wait``). Refused, with nothing changed, while another rollout is active or when
    ``canary`` runs what the deployment runs; a canary that cannot be placed or started leaves the
    deployment as it was."""
    store = deployer.store
    record = store.get_deployment(name)
    if record is None:
        known = ", ".join(d.name for d in store.list_deployments()) or "none"
        raise NotFoundError(f"no deployment named {name!r} (deployments: {known})")
    previous = store.get_rollout(name)
    if previous is not None and previous.active:
        raise UserError(
            f"deployment {name} already has a rollout in progress ({previous.status.value}, "
            f"step {previous.weight}%)",
            hint=f"`llmctl rollout promote {name}` or `llmctl rollout abort {name}` first",
        )
    stable = record.spec
    canary = canary.model_copy(update={k: getattr(stable, k) for k in {"name", *IN_PLACE_FIELDS}})
    if spec_version(canary) == spec_version(stable):
        raise UserError(f"deployment {name} already runs that", hint="--set a value that differs")
    check_engine_args(canary)
    check_sources(canary)
    now = deployer.clock()
    try:
        rollout = RolloutRecord(
            deployment=name,
            stable=stable,
            canary=canary,
            stable_version=spec_version(stable),
            canary_version=spec_version(canary),
            started_at=now,
            step_started_at=now,
            updated_at=now,
            **({"steps": steps} if steps else {}),
        )
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, what="--steps")) from None
    store.put_rollout(rollout)
    try:
        rollout, _ = converge(
            deployer, name, wait=wait, timeout=timeout, drain_timeout=drain_timeout, source=source
        )
    except BaseException:
        _undo_start(deployer, rollout, previous)
        raise
    changed = ", ".join(_changed(stable, canary))
    _event(
        deployer,
        rollout,
        "RolloutStarted",
        f"canary {rollout.canary_version} ({changed}) takes {rollout.weight}% of traffic; stable "
        f"{rollout.stable_version}; steps {', '.join(f'{w}%' for w in rollout.steps)}",
        source=source,
        metrics=None,
    )
    return rollout


def _undo_start(deployer: Deployer, rollout: RolloutRecord, previous: RolloutRecord | None) -> None:
    """Stop the canary replicas a failed start made and put the store back as it was."""
    for rec in deployer.store.list_replicas(rollout.deployment):
        if rec.version == rollout.canary_version:
            try:
                deployer.stop_replica(rec)
            except LaunchError:
                logger.exception("could not stop canary replica %s", rec.id)
    if previous is None:
        deployer.store.delete_rollout(rollout.deployment)
    else:
        deployer.store.put_rollout(previous)


def _changed(old: DeploymentSpec, new: DeploymentSpec) -> list[str]:
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    out = []
    for key, value in after.items():
        if isinstance(value, dict) and isinstance(before.get(key), dict):
            out += [f"{key}.{k}={v}" for k, v in value.items() if before[key].get(k) != v]
            out += [f"{key}.{k} removed" for k in before[key] if k not in value]
        elif before.get(key) != value:
            out.append(f"{key}={value}")
    return out


def promote(
    deployer: Deployer,
    name: str,
    *,
    reason: str,
    source: str = "llmctl",
    metrics: ControllerMetrics | None = None,
) -> RolloutRecord:
    """The next step of ``name``'s rollout (its replicas are changed by :func:`converge`); at the last
    step, once only canary replicas are left, the rollout succeeds: the canary becomes the spec."""
    rollout = get_rollout(deployer, name)
    if rollout.status is not RolloutStatus.PROGRESSING:
        raise UserError(f"the rollout of {name} is {rollout.status.value}; it cannot be promoted")
    if rollout.step + 1 < len(rollout.steps):
        step = rollout.step + 1
        rollout = _save(
            deployer, rollout, step=step, step_started_at=deployer.clock(), reason=f"promoted: {reason}"
        )
        _event(
            deployer,
            rollout,
            "RolloutPromoted",
            f"canary {rollout.canary_version} to {rollout.steps[step]}% of traffic: {reason}",
            source=source,
            metrics=metrics,
        )
        return rollout
    record = deployer.store.get_deployment(name)
    assert record is not None  # get_rollout checked it
    left = [r for r in _members(deployer, name) if r.version != rollout.canary_version]
    if left:
        raise UserError(
            f"the rollout of {name} still has {len(left)} old replica(s) to replace",
            hint="wait until `llmctl rollout status` shows none, then promote",
        )
    spec = rollout.canary.model_copy(update={k: getattr(record.spec, k) for k in IN_PLACE_FIELDS})
    deployer.store.put_deployment(record.model_copy(update={"spec": spec, "updated_at": deployer.clock()}))
    rollout = _save(deployer, rollout, status=RolloutStatus.SUCCEEDED, reason=reason)
    _event(
        deployer,
        rollout,
        "RolloutSucceeded",
        f"version {rollout.canary_version} runs all {spec.replicas} replica(s): {reason}",
        source=source,
        metrics=metrics,
    )
    return rollout


def abort(
    deployer: Deployer,
    name: str,
    *,
    reason: str,
    source: str = "llmctl",
    metrics: ControllerMetrics | None = None,
) -> RolloutRecord:
    """Roll ``name``'s rollout back: the canary takes no more traffic at once; :func:`converge` then
    brings the stable version back to its replica count and stops the canary replicas."""
    rollout = get_rollout(deployer, name)
    if rollout.status is RolloutStatus.ROLLING_BACK:
        return rollout
    rollout = _save(deployer, rollout, status=RolloutStatus.ROLLING_BACK, reason=reason)
    _event(
        deployer,
        rollout,
        "RollingBack",
        f"canary {rollout.canary_version} rolled back at {rollout.steps[rollout.step]}%: {reason}",
        source=source,
        metrics=metrics,
        warning=True,
    )
    return rollout


# --- replica changes


def _members(deployer: Deployer, name: str) -> list[ReplicaRecord]:
    return [r for r in deployer.store.list_replicas(name) if r.state not in LEAVING_STATES]


def min_available(spec: DeploymentSpec) -> int:
    """Ready replicas a rollout never goes below: the deployment's ``min_replicas``, else its count."""
    return spec.min_replicas if spec.min_replicas is not None else spec.replicas


def converge(
    deployer: Deployer,
    name: str,
    *,
    wait: bool,
    timeout: float = 600.0,
    drain_timeout: float = 120.0,
    source: str = "llmctl",
    metrics: ControllerMetrics | None = None,
) -> tuple[RolloutRecord, bool]:
    """Bring ``name``'s replicas towards its rollout's step: start a replica of the version that grows,
    wait for it, drain one of the version that shrinks (never below :func:`min_available` ready
    replicas). Without ``wait``, at most one change per call (a controller pass); with it, until the
    step is in place or ``timeout``. Returns the rollout and whether the step is in place; a rollback
    whose old replicas are all back ends here (``rolled-back``)."""
    deadline = deployer.clock() + timeout
    while True:
        rollout = get_rollout(deployer, name, active=False)
        record = deployer.store.get_deployment(name)
        assert record is not None  # get_rollout checked it
        if not rollout.active:
            return rollout, True
        if wait:
            deployer.refresh(name)  # loading replicas become ready here (the controller probes its own)
        placed, acted = _one_change(
            deployer, rollout, record, drain_timeout=drain_timeout, source=source, metrics=metrics
        )
        if placed:
            return get_rollout(deployer, name, active=False), True
        if not wait:
            return rollout, False
        if deployer.clock() > deadline:
            raise LaunchError(
                f"the rollout of {name} did not reach its step in {timeout:.0f}s",
                hint=f"see `llmctl rollout status {name}` and `llmctl events {name}`",
            )
        if not acted:
            deployer.sleep(1.0)


def _one_change(
    deployer: Deployer,
    rollout: RolloutRecord,
    record: DeploymentRecord,
    *,
    drain_timeout: float,
    source: str,
    metrics: ControllerMetrics | None,
) -> tuple[bool, bool]:
    """One replica change towards the step: ``(in place, changed something)``."""
    members = _members(deployer, rollout.deployment)
    canary = [r for r in members if r.version == rollout.canary_version]
    stable = [r for r in members if r.version != rollout.canary_version]
    count = record.spec.replicas
    back = rollout.status is RolloutStatus.ROLLING_BACK
    want_canary, want_stable = (0, count) if back else step_targets(count, rollout.weight)
    grow, want_grow, grow_spec = (
        (stable, want_stable, rollout.stable)
        if back
        else (
            canary,
            want_canary,
            rollout.canary,
        )
    )
    shrink, want_shrink = (canary, want_canary) if back else (stable, want_stable)
    # Shrink first where the ready replicas stay at the floor without the one leaving (it frees the room
    # the other version needs); grow first otherwise.
    if len(shrink) > want_shrink:
        victim = _removal_order(shrink)[0]
        ready = sum(1 for r in members if r.state is ReplicaState.READY)
        if victim.state is not ReplicaState.READY or ready - 1 >= min_available(record.spec):
            drain_replicas(
                deployer,
                [victim],
                timeout=drain_timeout,
                reason=f"rollout of {rollout.deployment}",
                source=source,
                metrics=metrics,
            )
            return False, True
    if len(grow) < want_grow:
        _add(deployer, rollout, record, grow_spec, members, source=source, metrics=metrics)
        return False, True
    if sum(1 for r in grow if r.state is ReplicaState.READY) < want_grow or len(shrink) > want_shrink:
        return False, False  # loading (capacity on its way), or the floor holds a replica back
    if back:
        ids = ", ".join(sorted(r.id for r in stable))
        done = _save(deployer, rollout, status=RolloutStatus.ROLLED_BACK)
        _event(
            deployer,
            done,
            "RolledBack",
            f"version {rollout.stable_version} runs alone again ({ids}); canary stopped",
            source=source,
            metrics=metrics,
            warning=True,
        )
        return True, True
    return True, False


_REMOVAL_RANK = {ReplicaState.PENDING: 0, ReplicaState.FAILED: 1, ReplicaState.UNHEALTHY: 2}
"""A replica serving nothing goes first; ready and loading ones after them."""


def _removal_order(replicas: list[ReplicaRecord]) -> list[ReplicaRecord]:
    # Serving nothing first (see _REMOVAL_RANK), then the oldest: the stable replicas go in the order
    # they came, which keeps the plan's slots in use short-lived.
    return sorted(replicas, key=lambda r: (_REMOVAL_RANK.get(r.state, 3), r.created_at, r.index))


def _add(
    deployer: Deployer,
    rollout: RolloutRecord,
    record: DeploymentRecord,
    spec: DeploymentSpec,
    members: list[ReplicaRecord],
    *,
    source: str,
    metrics: ControllerMetrics | None,
) -> ReplicaRecord:
    """Start one replica of ``spec`` beside ``members`` (anti-affinity), without waiting for it."""
    spec = spec.model_copy(update={"replicas": record.spec.replicas})
    model = deployer.catalog.get(spec.model)
    plan = deployer.place_around(spec, model, 1, members)
    if not plan.replicas:
        why = deployer.no_room_reason(plan)
        message = f"rollout of {rollout.deployment} waits for room for one more replica: {why}"
        last = deployer.store.list_events(rollout.deployment, limit=1)
        if not last or last[0].message != message:  # once, not every pass
            _event(
                deployer,
                rollout,
                "NoRoom",
                message,
                source=source,
                metrics=metrics,
                warning=True,
            )
        raise PlacementError(f"no room for one more replica of {rollout.deployment}: {why}")
    used = {r.index for r in deployer.store.list_replicas(rollout.deployment)}
    index = next(i for i in range(len(used) + 1) if i not in used)
    return deployer.start_version(record, spec, index, plan.replicas[0])


# --- the controller's part


def sample_of(
    now: float,
    rollout: RolloutRecord,
    replicas: list[ReplicaRecord],
    ttft: Mapping[str, HistogramSample | None],
    pages: list[tuple[str, str]],
) -> Sample:
    """This pass's counters of the rollout's replicas: each engine's TTFT histogram (``ttft``, by replica
    id) and each gateway's calls and failed calls to each replica (``pages``: its ``/metrics``)."""
    mine = {r.id: r.version == rollout.canary_version for r in replicas if r.deployment == rollout.deployment}
    sources = [SourceSample(rid, canary, ttft=ttft.get(rid)) for rid, canary in mine.items() if ttft.get(rid)]
    for url, text in pages:
        if not text:
            continue  # a gateway that did not answer: its counters are unknown, not zero
        calls = parse_counters(text, _CALLS, "replica")
        errors = parse_counters(text, _ERRORS, "replica")
        for rid, canary in mine.items():
            if rid in calls:
                sources.append(SourceSample(f"{url}|{rid}", canary, calls[rid], errors.get(rid, 0.0)))
    return Sample(now, tuple(sources))


def drive(
    deployer: Deployer,
    name: str,
    *,
    sample: Sample,
    state: RolloutState,
    policy: RolloutPolicy,
    now: float,
    drain_timeout: float,
    metrics: ControllerMetrics | None,
) -> tuple[RolloutState, RolloutDecision | None]:
    """One controller pass over ``name``'s rollout: one replica change towards its step, then the
    policy's judgement of the canary (promote, roll back or hold), applied and recorded."""
    source = "controller"
    try:
        rollout, placed = converge(
            deployer, name, wait=False, drain_timeout=drain_timeout, source=source, metrics=metrics
        )
    except PlacementError as exc:
        logger.warning("%s", exc.message)
        rollout, placed = get_rollout(deployer, name, active=False), False
    if rollout.status is not RolloutStatus.PROGRESSING:
        return state, None
    broken = [
        r
        for r in _members(deployer, name)
        if r.version == rollout.canary_version and r.state is ReplicaState.FAILED
    ]
    if broken:
        why = f"canary replica {broken[0].id} failed: {broken[0].message or 'process gone'}"
        abort(deployer, name, reason=why, source=source, metrics=metrics)
        return state, RolloutDecision(Action.ROLLBACK, why)
    ctx = RolloutContext(policy, now, rollout.step, tuple(rollout.steps), placed, sample)
    decision, state = decide(ctx, state)
    if decision.action is Action.ROLLBACK:
        rollout = abort(deployer, name, reason=decision.reason, source=source, metrics=metrics)
    elif decision.action is Action.PROMOTE:
        try:
            rollout = promote(deployer, name, reason=decision.reason, source=source, metrics=metrics)
        except UserError as exc:  # old replicas still to replace at the last step: next pass
            logger.info("rollout of %s: %s", name, exc.message)
    if decision.action is not Action.HOLD or (decision.reason, decision.numbers) != (
        rollout.reason,
        rollout.comparison,
    ):
        reason = rollout.reason if decision.action is not Action.HOLD else decision.reason
        _save(deployer, rollout, reason=reason, comparison=decision.numbers)
    return state, decision
