"""Changing running deployments and nodes in place: :func:`scale`, :func:`drain_replicas`, and
:func:`cordon`, :func:`uncordon`, :func:`drain_node`.

Scale up places the new replicas around the ones that run (their GPUs taken, their nodes avoided), on the
schedulable nodes, and launches them on the path ``deploy`` uses; what the planner cannot place is recorded
as ``pending`` replicas carrying its reason. Scale down removes pending replicas first, then failed and
unhealthy ones, then the least loaded ready ones (the engines' request gauges), then the youngest, and
drains each before it stops: the gateway routes no new request to a ``draining`` replica, and the replica
is stopped once its engine reports no running or waiting request, or at the drain timeout.

A cordoned node (its :class:`~controlplane.state.base.NodeRecord` unschedulable) is left out of every new
placement; draining a node cordons it, starts a replacement elsewhere for each of its replicas first, then
drains and stops them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.controller.deploy import LEAVING_STATES, Deployer
from controlplane.controller.events import record_event
from controlplane.errors import NotFoundError, PlacementError, UserError, describe_validation_error
from controlplane.spec import (
    DeploymentRecord,
    DeploymentSpec,
    ReplicaPlan,
    ReplicaRecord,
    ReplicaState,
)
from controlplane.state.base import NodeRecord

if TYPE_CHECKING:
    from controlplane.controller.reconcile import ControllerMetrics

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DRAIN_SETTLE_S",
    "DrainOutcome",
    "NodeDrainResult",
    "ScaleResult",
    "cordon",
    "drain_node",
    "drain_replicas",
    "raise_unplaced",
    "replica_ongoing",
    "scale",
    "uncordon",
]

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 120.0
"""How long a drain lets in-flight requests finish before the replica is stopped anyway."""
DRAIN_SETTLE_S = 2.0
"""Wait after marking replicas draining before the first idle check: gateways re-read the store every
``discovery_interval_s`` (0.5 s by default), and a request they route meanwhile must find its replica up."""
NO_ROOM = "no room"
"""Message prefix of a pending replica the planner could not place (``no room: <planner's reason>``)."""

# Removal order, first removed first: a replica serving nothing goes before one that serves.
_REMOVAL_RANK = {
    ReplicaState.PENDING: 0,  # holds nothing
    ReplicaState.FAILED: 1,  # process gone
    ReplicaState.UNHEALTHY: 2,  # routed nothing
    ReplicaState.READY: 3,
    ReplicaState.STARTING: 4,  # capacity on its way: removed last
}


class ScaleResult(BaseModel):
    """What :func:`scale` did."""

    model_config = ConfigDict(extra="forbid")

    deployment: str
    before: int = Field(ge=0)
    """Desired replicas before the call."""
    after: int = Field(ge=0)
    """Desired replicas now (what was asked)."""
    added: list[str] = Field(default_factory=list)
    """Replicas started (ready unless ``wait`` was off)."""
    removed: list[str] = Field(default_factory=list)
    """Replicas drained and stopped, or pending ones dropped."""
    unplaced: int = Field(default=0, ge=0)
    """Replicas asked for that the planner could not place: recorded as ``pending``."""
    reason: str = ""
    """The planner's reason when ``unplaced``; empty otherwise."""

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed) or self.before != self.after

    def describe(self) -> str:
        """One line for people: ``scaled web from 1 to 3 replicas (added web-1, web-2)``."""
        parts = []
        if self.added:
            parts.append(f"added {', '.join(self.added)}")
        if self.removed:
            parts.append(f"removed {', '.join(self.removed)}")
        if self.unplaced:
            parts.append(f"{self.unplaced} pending")
        detail = f" ({'; '.join(parts)})" if parts else ""
        return f"scaled {self.deployment} from {self.before} to {self.after} replicas{detail}"


class DrainOutcome(BaseModel):
    """One drained replica: how long it took and whether requests were still in flight when it stopped."""

    model_config = ConfigDict(extra="forbid")

    replica: str
    seconds: float
    in_flight: float = 0.0
    """Running + waiting requests at the stop (non-zero only when the timeout ran out)."""
    timed_out: bool = False


def raise_unplaced(result: ScaleResult) -> None:
    """The one-line refusal for a scale that left replicas pending (exit code 3)."""
    if not result.unplaced:
        return
    placed = result.after - result.unplaced
    raise PlacementError(
        f"{result.deployment}: {result.unplaced} of {result.after} replica(s) could not be placed and "
        f"wait as pending ({placed} placed): {result.reason}",
        hint=f"free or add GPUs, uncordon a node, or `llmctl scale {result.deployment} {placed}`",
    )


def replica_ongoing(rec: ReplicaRecord, timeout: float = 2.0) -> float | None:
    """Running + waiting requests on ``rec``'s engine (its metrics page); None when unreadable."""
    import httpx

    from controlplane.engines.metrics import parse_vllm_metrics

    if not rec.endpoint:
        return None
    try:
        resp = httpx.get(rec.endpoint + rec.probes.metrics, timeout=timeout)
    except httpx.HTTPError:
        return None
    load = parse_vllm_metrics(resp.text) if resp.status_code == 200 else None
    return load.ongoing if load is not None else None


def _with_replicas(spec: DeploymentSpec, replicas: int) -> DeploymentSpec:
    try:
        return DeploymentSpec.model_validate({**spec.model_dump(), "replicas": replicas})
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, what=f"scale of {spec.name}")) from None


def _free_indices(used: Iterable[int], count: int) -> list[int]:
    """The ``count`` smallest indices not in ``used``."""
    taken, i = set(used), 0
    out: list[int] = []
    while len(out) < count:
        if i not in taken:
            out.append(i)
        i += 1
    return out


def _set_slot(slots: list[ReplicaPlan], index: int, rp: ReplicaPlan) -> None:
    # Slots between the plan's end and ``index`` belong to pending replicas: they hold a copy of ``rp``
    # until a placement overwrites them, and nothing launches from a slot without overwriting it first.
    while len(slots) <= index:
        slots.append(rp)
    slots[index] = rp


def scale(
    deployer: Deployer,
    name: str,
    replicas: int,
    *,
    reason: str,
    source: str = "llmctl",
    wait: bool = True,
    timeout: float = 600.0,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    metrics: ControllerMetrics | None = None,
) -> ScaleResult:
    """Bring deployment ``name`` to ``replicas`` in place; ``reason`` goes into its events.

    Existing replicas are never restarted. A scale the planner cannot fully place adds what fits and
    returns ``unplaced`` with the planner's reason (the rest recorded as pending, event ``NoRoom``); the
    caller decides whether that is an error (:func:`raise_unplaced`). ``source`` and ``metrics`` say who
    acts (``controller`` with its metrics, or ``llmctl``).
    """
    store = deployer.store
    record = store.get_deployment(name)
    if record is None:
        known = ", ".join(d.name for d in store.list_deployments()) or "none"
        raise NotFoundError(f"no deployment named {name!r} (deployments: {known})")
    rollout = store.get_rollout(name)
    if rollout is not None and rollout.active and replicas != record.spec.replicas:
        raise UserError(
            f"deployment {name} has a rollout in progress ({rollout.status.value}); it is not scaled",
            hint=f"`llmctl rollout promote {name}` to the end or `llmctl rollout abort {name}` first",
        )
    spec = _with_replicas(record.spec, replicas)
    before = record.spec.replicas
    members = [r for r in store.list_replicas(name) if r.state not in LEAVING_STATES]
    placed = [r for r in members if r.state is not ReplicaState.PENDING]
    pending = [r for r in members if r.state is ReplicaState.PENDING]
    if replicas > len(placed):
        result = _grow(deployer, record, spec, placed, pending, wait=wait, timeout=timeout)
    elif replicas < len(members):
        result = _shrink(
            deployer, record, spec, members, drain_timeout=drain_timeout, reason=reason, source=source
        )
    else:
        result = ScaleResult(deployment=name, before=before, after=replicas)
        if before != replicas:
            store.put_deployment(record.model_copy(update={"spec": spec, "updated_at": deployer.clock()}))
    result.before = before
    _events(deployer, result, reason=reason, source=source, metrics=metrics)
    return result


def _grow(
    deployer: Deployer,
    record: DeploymentRecord,
    spec: DeploymentSpec,
    placed: list[ReplicaRecord],
    pending: list[ReplicaRecord],
    *,
    wait: bool,
    timeout: float,
) -> ScaleResult:
    added, unplaced, why = _add_replicas(
        deployer, record, spec, placed, pending, count=spec.replicas - len(placed), wait=wait, timeout=timeout
    )
    return ScaleResult(
        deployment=spec.name,
        before=record.spec.replicas,
        after=spec.replicas,
        added=added,
        unplaced=unplaced,
        reason=why,
    )


def _add_replicas(
    deployer: Deployer,
    record: DeploymentRecord,
    spec: DeploymentSpec,
    stay: list[ReplicaRecord],
    pending: list[ReplicaRecord],
    *,
    count: int,
    wait: bool,
    timeout: float,
) -> tuple[list[str], int, str]:
    """Place ``count`` replicas around ``stay`` (anti-affinity), record ``spec`` as desired, launch what
    was placed and record the rest as pending (replacing ``pending``). Returns (started ids, unplaced,
    the planner's reason)."""
    store, name = deployer.store, spec.name
    model = deployer.catalog.get(spec.model)
    more = deployer.place_around(spec, model, count, stay)
    got = more.replicas[:count]
    dropped = {r.id for r in pending}
    # Draining replicas keep their ids until they stop: new ones take indices nobody holds.
    used = [r.index for r in store.list_replicas(name) if r.id not in dropped]
    free = _free_indices(used, count)
    slots = list(record.plan.replicas)
    for index, rp in zip(free, got, strict=False):
        _set_slot(slots, index, rp)
    unplaced = count - len(got)
    why = deployer.no_room_reason(more) if unplaced else ""
    now = deployer.clock()
    plan = record.plan.model_copy(
        update={"replicas": slots, "unplaced": unplaced, "reasons": list(more.reasons) if unplaced else []}
    )
    desired = record.model_copy(update={"spec": spec, "plan": plan, "updated_at": now})
    for rec in pending:
        store.delete_replica(rec.id)
    try:
        started = deployer.launch(
            desired, model, free[: len(got)], previous=record, wait=wait, timeout=timeout
        )
    except BaseException:
        for rec in pending:  # the launch was rolled back: the pending replicas wait as before
            store.put_replica(rec)
        raise
    for index in free[len(got) :]:
        store.put_replica(
            ReplicaRecord(
                id=f"{name}-{index}",
                deployment=name,
                index=index,
                model=name,
                engine=spec.engine,
                node="",
                state=ReplicaState.PENDING,
                message=f"{NO_ROOM}: {why}",
                created_at=now,
                updated_at=now,
            )
        )
    return [r.id for r in started], unplaced, why


def _removal_order(members: list[ReplicaRecord]) -> list[ReplicaRecord]:
    loads = {r.id: replica_ongoing(r) for r in members if r.state is ReplicaState.READY}

    def key(rec: ReplicaRecord) -> tuple[int, float, float]:
        load = loads.get(rec.id)
        return (
            _REMOVAL_RANK.get(rec.state, 0),  # unhealthy first (see _REMOVAL_RANK)
            load if load is not None else float("inf"),  # then least loaded; unmeasured last
            -rec.created_at,  # then youngest
        )

    return sorted(members, key=key)


def _shrink(
    deployer: Deployer,
    record: DeploymentRecord,
    spec: DeploymentSpec,
    members: list[ReplicaRecord],
    *,
    drain_timeout: float,
    reason: str,
    source: str,
) -> ScaleResult:
    victims = _removal_order(members)[: len(members) - spec.replicas]
    deployer.check_reach(victims, "scale")
    deployer.store.put_deployment(record.model_copy(update={"spec": spec, "updated_at": deployer.clock()}))
    for rec in victims:
        if rec.state is ReplicaState.PENDING:
            deployer.store.delete_replica(rec.id)
    running = [r for r in victims if r.state is not ReplicaState.PENDING]
    drain_replicas(deployer, running, timeout=drain_timeout, reason=reason, source=source)
    return ScaleResult(
        deployment=spec.name,
        before=record.spec.replicas,
        after=spec.replicas,
        removed=[r.id for r in victims],
    )


def drain_replicas(
    deployer: Deployer,
    replicas: list[ReplicaRecord],
    *,
    timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    reason: str,
    source: str = "llmctl",
    settle_s: float = DRAIN_SETTLE_S,
    metrics: ControllerMetrics | None = None,
) -> list[DrainOutcome]:
    """Drain then stop ``replicas``: mark them ``draining`` (no new requests routed), wait until each
    engine reports no running or waiting request (or its metrics cannot be read) or ``timeout`` passes,
    then stop it and remove its record. Events ``Drained`` and ``Stopped`` say how each ended."""
    if not replicas:
        return []
    deployer.check_reach(replicas, "drain")
    store, clock = deployer.store, deployer.clock
    started = clock()
    for rec in replicas:
        rec.state, rec.message, rec.updated_at = ReplicaState.DRAINING, f"draining: {reason}", started
        store.put_replica(rec)
        if deployer.progress is not None:
            deployer.progress(rec.id, f"{rec.id}: draining")
    deployer.sleep(settle_s)
    deadline = started + timeout
    left = list(replicas)
    out: list[DrainOutcome] = []
    while left:
        for rec in list(left):
            ongoing = replica_ongoing(rec)
            expired = clock() >= deadline
            if not ongoing or expired:
                left.remove(rec)
                outcome = DrainOutcome(
                    replica=rec.id,
                    seconds=round(clock() - started, 3),
                    in_flight=ongoing or 0.0,
                    timed_out=bool(ongoing) and expired,
                )
                out.append(outcome)
                _stop_drained(deployer, rec, outcome, source=source, metrics=metrics)
        if left:
            deployer.sleep(0.5)
    return out


def _stop_drained(
    deployer: Deployer,
    rec: ReplicaRecord,
    outcome: DrainOutcome,
    *,
    source: str,
    metrics: ControllerMetrics | None,
) -> None:
    def event(reason: str, message: str, *, warning: bool = False) -> None:
        record_event(
            deployer.store,
            reason,
            message,
            object=f"replica/{rec.id}",
            deployment=rec.deployment,
            type="Warning" if warning else "Normal",
            source=source,
            metrics=metrics,
            clock=deployer.clock,
        )

    if outcome.timed_out:
        event(
            "Drained",
            f"drain timed out after {outcome.seconds:.0f}s with {outcome.in_flight:.0f} request(s) in flight",
            warning=True,
        )
    else:
        event("Drained", f"no request in flight after {outcome.seconds:.1f}s")
    deployer.stop_replica(rec)
    event("Stopped", f"stopped on {rec.node or 'no node'}")


def _events(
    deployer: Deployer,
    result: ScaleResult,
    *,
    reason: str,
    source: str,
    metrics: ControllerMetrics | None,
) -> None:
    why = f": {reason}" if reason else ""

    def event(kind: str, message: str, *, warning: bool = False) -> None:
        record_event(
            deployer.store,
            kind,
            message,
            deployment=result.deployment,
            type="Warning" if warning else "Normal",
            source=source,
            metrics=metrics,
            clock=deployer.clock,
        )

    span = f"from {result.before} to {result.after} replicas{why}"
    if result.added or (result.after > result.before and not result.removed):
        event(
            "Scaled", f"scaled up {span}" + (f" (started {', '.join(result.added)})" if result.added else "")
        )
    if result.removed or result.after < result.before:
        event(
            "ScaledDown",
            f"scaled down {span}" + (f" (removed {', '.join(result.removed)})" if result.removed else ""),
        )
    if result.unplaced:
        event("NoRoom", f"{result.unplaced} replica(s) pending: {result.reason}", warning=True)


# --- nodes: cordon, uncordon, drain


class NodeDrainResult(BaseModel):
    """What :func:`drain_node` did."""

    model_config = ConfigDict(extra="forbid")

    node: str
    replaced: dict[str, list[str]] = Field(default_factory=dict)
    """Per deployment, the replicas started elsewhere before the node's were drained."""
    drained: list[DrainOutcome] = Field(default_factory=list)
    unplaced: int = Field(default=0, ge=0)
    """Replacements the planner could not place (recorded as pending)."""
    reason: str = ""


def _known_node(deployer: Deployer, node: str) -> None:
    try:
        deployer.fleet.node(node)
    except KeyError:
        known = ", ".join(n.name for n in deployer.fleet.nodes) or "none"
        raise NotFoundError(f"no node named {node!r} in the fleet (nodes: {known})") from None


def cordon(deployer: Deployer, node: str, *, reason: str = "", source: str = "llmctl") -> bool:
    """Mark ``node`` unschedulable (no new placements; its replicas keep running); False if it already was."""
    why = f": {reason}" if reason else ""
    return _set_schedulable(
        deployer, node, False, reason=reason, message=f"no new replicas on {node}{why}", source=source
    )


def uncordon(deployer: Deployer, node: str, *, source: str = "llmctl") -> bool:
    """Make ``node`` schedulable again; False if it already was."""
    return _set_schedulable(
        deployer, node, True, reason="", message=f"{node} takes new replicas again", source=source
    )


def _set_schedulable(
    deployer: Deployer, node: str, schedulable: bool, *, reason: str, message: str, source: str
) -> bool:
    _known_node(deployer, node)
    current = deployer.store.get_node(node)
    if (current.schedulable if current is not None else True) is schedulable:
        return False
    record = NodeRecord(name=node, schedulable=schedulable, reason=reason, updated_at=deployer.clock())
    deployer.store.put_node(record)
    record_event(
        deployer.store,
        "Uncordoned" if schedulable else "Cordoned",
        message,
        object=f"node/{node}",
        source=source,
        clock=deployer.clock,
    )
    return True


def drain_node(
    deployer: Deployer,
    node: str,
    *,
    timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    start_timeout: float = 600.0,
    source: str = "llmctl",
) -> NodeDrainResult:
    """Cordon ``node``, start a replacement elsewhere for each of its replicas (placed like a scale up),
    then drain the node's replicas (no new requests; in-flight ones finish up to ``timeout``) and stop
    them. Replacements that do not fit are recorded as pending and the drain goes on: the node is being
    emptied either way; ``unplaced`` says so."""
    _known_node(deployer, node)
    store = deployer.store
    on_node = [
        r
        for r in store.list_replicas()
        if r.state not in LEAVING_STATES
        and r.state is not ReplicaState.PENDING
        and (r.node == node or any(s.node == node for s in r.shards))
    ]
    deployer.check_reach(on_node, "drain")
    cordon(deployer, node, reason="drain", source=source)
    result = NodeDrainResult(node=node)
    reasons: list[str] = []
    for name in sorted({r.deployment for r in on_node}):
        victims = [r for r in on_node if r.deployment == name]
        record = store.get_deployment(name)
        if record is None:
            continue  # replicas without a desired deployment are drained, not replaced
        ids = {r.id for r in victims}
        stay = [
            r
            for r in store.list_replicas(name)
            if r.id not in ids and r.state not in LEAVING_STATES and r.state is not ReplicaState.PENDING
        ]
        added, unplaced, why = _add_replicas(
            deployer, record, record.spec, stay, [], count=len(victims), wait=True, timeout=start_timeout
        )
        result.replaced[name] = added
        if added:
            record_event(
                store,
                "Replaced",
                f"started {', '.join(added)} elsewhere to replace {', '.join(sorted(ids))} (drain of {node})",
                deployment=name,
                source=source,
                clock=deployer.clock,
            )
        if unplaced:
            result.unplaced += unplaced
            reasons.append(why)
            record_event(
                store,
                "NoRoom",
                f"{unplaced} replacement(s) for {node}'s replicas pending: {why}",
                type="Warning",
                deployment=name,
                source=source,
                clock=deployer.clock,
            )
    result.reason = "; ".join(dict.fromkeys(reasons))
    result.drained = drain_replicas(
        deployer, on_node, timeout=timeout, reason=f"drain of {node}", source=source
    )
    late = sum(1 for o in result.drained if o.timed_out)
    record_event(
        store,
        "Drained",
        f"{node} drained: {len(result.drained)} replica(s) stopped"
        + (f", {late} at the {timeout:.0f}s timeout" if late else "")
        + (f", {result.unplaced} replacement(s) pending" if result.unplaced else ""),
        type="Warning" if late or result.unplaced else "Normal",
        object=f"node/{node}",
        source=source,
        clock=deployer.clock,
    )
    return result
