"""The reconcile loop: probe replicas, update observed state, write targets, recommend replica counts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from controlplane.controller.autoscale import (
    AutoscaleConfig,
    AutoscaleContext,
    Decision,
    PolicyState,
    ReplicaLoad,
    decide,
)
from controlplane.controller.health import PROBED_STATES, HealthRule, Streak, judge, probe_path
from controlplane.engines.metrics import parse_vllm_metrics
from controlplane.errors import ConfigError, SarvError, describe_validation_error
from controlplane.spec import DeploymentRecord, Fleet, ReplicaRecord, ReplicaState

if TYPE_CHECKING:
    import httpx
    from prometheus_client import CollectorRegistry

    from controlplane.controller.lease import Lease
    from controlplane.state.base import StateStore

__all__ = [
    "ControllerConfig",
    "ControllerMetrics",
    "PassReport",
    "ProbeResult",
    "Reconciler",
    "load_controller_config",
    "serve_metrics",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_DEFAULT_RULE = HealthRule()


class ControllerConfig(BaseModel):
    """The controller's YAML file (``llmctl controller run --config``); command-line options win over it."""

    model_config = ConfigDict(extra="forbid")

    period_s: float = Field(default=5.0, gt=0, le=3600)
    """Seconds between the starts of two passes."""
    probe_timeout_s: float = Field(default=2.0, gt=0, le=60)
    """Limit of one replica's probe (health and metrics together)."""
    failure_threshold: int = Field(default=_DEFAULT_RULE.failure_threshold, ge=1, le=100)
    """Consecutive failed health checks before a ready replica is marked unhealthy."""
    success_threshold: int = Field(default=_DEFAULT_RULE.success_threshold, ge=1, le=100)
    """Consecutive passed health checks before an unhealthy replica is ready again."""
    slow_loop_s: float | None = Field(default=None, gt=0)
    """A pass taking longer is logged as slow; None means ``period_s``."""
    lease_ttl_s: float = Field(default=15.0, gt=0, le=3600)
    """Lifetime of the Redis lease; another controller takes over this long after the holder stops."""
    targets_file: Path | None = None
    """Prometheus ``file_sd`` file listing the ready replicas; None writes none."""
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    """Policy of every deployment not named in ``deployments``."""
    deployments: dict[str, AutoscaleConfig] = Field(default_factory=dict)
    """Per-deployment policy, replacing ``autoscale`` for that deployment."""

    def policy_for(self, deployment: str) -> AutoscaleConfig:
        return self.deployments.get(deployment, self.autoscale)

    @property
    def health_rule(self) -> HealthRule:
        return HealthRule(failure_threshold=self.failure_threshold, success_threshold=self.success_threshold)


def load_controller_config(path: Path | None, **overrides: object) -> ControllerConfig:
    """The config file at ``path`` (none: defaults) with ``overrides`` (non-None values) on top."""
    import yaml

    data: dict[str, object] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read controller config {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"controller config {path} is not valid YAML: {exc}".splitlines()[0]) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"controller config {path} must be a mapping of settings")
        data = dict(loaded or {})
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ControllerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, what="controller config")) from None


class ControllerMetrics:
    """The controller's own Prometheus series, in a registry of its own (no global default registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.phase_seconds = Gauge(
            "sarv_controller_phase_seconds", "Duration of the last run of each phase.", ["phase"], registry=r
        )
        self.loop_seconds = Gauge("sarv_controller_loop_seconds", "Duration of the last pass.", registry=r)
        self.phase_errors = Counter(
            "sarv_controller_phase_errors_total", "Phases that raised, by phase.", ["phase"], registry=r
        )
        self.slow_loops = Counter(
            "sarv_controller_slow_loops_total", "Passes slower than slow_loop_s.", registry=r
        )
        self.passes = Counter("sarv_controller_passes_total", "Passes run (leader or not).", registry=r)
        self.leader = Gauge(
            "sarv_controller_leader", "1 while this controller holds the lease and acts.", registry=r
        )
        self.replicas = Gauge(
            "sarv_controller_replicas", "Replicas in the store by observed state.", ["state"], registry=r
        )
        self.recommended = Gauge(
            "sarv_controller_recommended_replicas",
            "Replica count the autoscaling policy recommends.",
            ["deployment"],
            registry=r,
        )
        self.current = Gauge(
            "sarv_controller_current_replicas",
            "Replicas of the deployment that exist (ready, unhealthy, loading).",
            ["deployment"],
            registry=r,
        )
        self.load = Gauge(
            "sarv_controller_ongoing_requests",
            "Waiting + running requests over the deployment's measured replicas.",
            ["deployment"],
            registry=r,
        )
        self.deployment_replicas = Gauge(
            "sarv_deployment_replicas",
            "Replicas of a deployment: desired, current (placed, not leaving), ready, loading, pending.",
            ["deployment", "state"],
            registry=r,
        )
        self.unplaced = Gauge(
            "sarv_deployment_unplaced_replicas",
            "Replicas asked for that the planner could not place, by reason (no_room …).",
            ["deployment", "reason"],
            registry=r,
        )
        self.events = Counter(
            "sarv_controller_events_total",
            "Events the controller recorded, by reason and type (Normal, Warning).",
            ["reason", "type"],
            registry=r,
        )
        self.node_gpus = Gauge(
            "sarv_node_gpus",
            "GPUs of a node by state: allocated (held by a replica) or free.",
            ["node", "gpu_type", "state"],
            registry=r,
        )
        self.node_schedulable = Gauge(
            "sarv_node_schedulable",
            "1 while the node takes new replicas, 0 while it is cordoned.",
            ["node"],
            registry=r,
        )


def serve_metrics(metrics: ControllerMetrics, host: str, port: int) -> Callable[[], None]:
    """Serve ``metrics`` on ``http://host:port/metrics`` in a thread; returns the function stopping it."""
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve controller metrics on {host}:{port}: {exc.strerror}",
            hint="pick a free --metrics-port (0 turns the endpoint off)",
        ) from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop


@dataclass(frozen=True)
class ProbeResult:
    replica_id: str
    ok: bool
    error: str = ""
    ongoing: float | None = None
    """Waiting + running requests from the replica's /metrics (ready replicas only; None if unread)."""


@dataclass
class PassReport:
    """What one pass did; returned by :meth:`Reconciler.run_once` for logs and tests."""

    leader: bool = False
    probed: int = 0
    changed: list[str] = field(default_factory=list)
    """Replica ids whose state this pass changed."""
    targets_written: bool = False
    decisions: dict[str, Decision] = field(default_factory=dict)
    failed_phases: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Reconciler:
    """One controller. Every dependency is injected: store, HTTP client, lease, clocks and metrics.

    ``run_once`` is one pass of phases (lease, load, probe, update, targets, autoscale), each in its own
    try/except so that a failing subsystem is logged and counted without stopping the others or the loop.
    """

    store: StateStore
    client: httpx.AsyncClient
    config: ControllerConfig = field(default_factory=ControllerConfig)
    lease: Lease | None = None
    """None acts unconditionally (one controller by construction, e.g. tests of the loop itself)."""
    metrics: ControllerMetrics = field(default_factory=ControllerMetrics)
    api_key: SecretStr | None = None
    """Key the engines require on ``/v1/*``: the ready probe of a loading replica needs it."""
    fleet: Fleet | None = None
    """The fleet, for the per-node GPU and schedulable series; None exports none of them."""
    clock: Callable[[], float] = time.time
    """Wall clock for ``updated_at``."""
    monotonic: Callable[[], float] = time.monotonic
    """Clock of the autoscaling delays and of phase durations."""
    _streaks: dict[str, Streak] = field(default_factory=dict)
    _policy: dict[str, PolicyState] = field(default_factory=dict)
    _was_leader: bool = False
    _exported: set[str] = field(default_factory=set)
    """Deployments whose ``sarv_deployment_replicas`` series this controller has set."""

    # --- plumbing

    @contextmanager
    def _phase(self, name: str, report: PassReport) -> Iterator[None]:
        started = self.monotonic()
        try:
            yield
        except Exception:
            # The loop must outlive any one subsystem (HOUSE_STYLE #18): log with traceback, count, go on.
            logger.exception("controller phase %s failed", name)
            self.metrics.phase_errors.labels(name).inc()
            report.failed_phases.append(name)
        finally:
            self.metrics.phase_seconds.labels(name).set(self.monotonic() - started)

    def _forget(self) -> None:
        """Drop what only the acting controller may trust: streaks and policy runs restart from zero."""
        self._streaks.clear()
        self._policy.clear()

    # --- one pass

    async def run_once(self) -> PassReport:
        report = PassReport()
        started = self.monotonic()
        self.metrics.passes.inc()
        try:
            await self._pass(report)
        finally:
            report.seconds = self.monotonic() - started
            self.metrics.loop_seconds.set(report.seconds)
            slow = self.config.slow_loop_s or self.config.period_s
            if report.seconds > slow:
                self.metrics.slow_loops.inc()
                logger.warning("controller pass took %.2fs (slow_loop_s %.2fs)", report.seconds, slow)
        return report

    async def _pass(self, report: PassReport) -> None:
        with self._phase("lease", report):
            report.leader = self._take_lease()
        self.metrics.leader.set(1 if report.leader else 0)
        if not report.leader:
            return

        replicas: list[ReplicaRecord] | None = None
        deployments: list[DeploymentRecord] = []
        with self._phase("load", report):
            replicas = self.store.list_replicas()
            deployments = self.store.list_deployments()
        if replicas is None:
            return

        probes: dict[str, ProbeResult] = {}
        with self._phase("probe", report):
            probes = await self._probe_all(replicas)
            report.probed = len(probes)

        if not self._still_leader():
            return
        with self._phase("update", report):
            replicas = self._update(replicas, probes, report)
        for state in ReplicaState:
            self.metrics.replicas.labels(state.value).set(sum(1 for r in replicas if r.state is state))
        with self._phase("state_metrics", report):
            self._export_state(deployments, replicas)

        if not self._still_leader():
            return
        if self.config.targets_file is not None:
            with self._phase("targets", report):
                from controlplane.observability import write_replica_targets

                ready = [r for r in replicas if r.state is ReplicaState.READY]
                report.targets_written = write_replica_targets(self.config.targets_file, ready)

        with self._phase("autoscale", report):
            report.decisions = self._autoscale(deployments, replicas, probes)

    def _take_lease(self) -> bool:
        if self.lease is None:
            return True
        leader = False
        try:
            leader = self.lease.acquire()
        finally:
            if self._was_leader and not leader:
                logger.warning("controller %s lost the lease; it stops acting", self.lease.holder)
                self._forget()
            elif leader and not self._was_leader:
                logger.info("controller %s holds the lease and acts", self.lease.holder)
            self._was_leader = leader
        return leader

    def _still_leader(self) -> bool:
        """False when the lease may have run out during this pass: then nothing more is written."""
        if self.lease is None or self.lease.held():
            return True
        logger.warning("controller lease ran out during a pass; its results are dropped")
        self._was_leader = False
        self._forget()
        self.metrics.leader.set(0)
        return False

    # --- probe

    async def _probe_all(self, replicas: list[ReplicaRecord]) -> dict[str, ProbeResult]:
        todo = [r for r in replicas if r.state in PROBED_STATES and r.endpoint]
        results = await asyncio.gather(*(self._bounded(self._probe(r), r.id) for r in todo))
        return {p.replica_id: p for p in results}

    async def _bounded(self, probe: Awaitable[ProbeResult], replica_id: str) -> ProbeResult:
        # httpx's timeout bounds each socket operation, not a whole response trickled byte by byte.
        try:
            return await asyncio.wait_for(probe, timeout=self.config.probe_timeout_s)
        except TimeoutError:
            return ProbeResult(replica_id, ok=False, error=f"no answer within {self.config.probe_timeout_s}s")

    async def _probe(self, rec: ReplicaRecord) -> ProbeResult:
        import httpx

        base = rec.endpoint or ""
        loading = rec.state is ReplicaState.STARTING
        headers = {}
        if loading and self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key.get_secret_value()}"
        try:
            resp = await self.client.get(base + probe_path(rec), headers=headers)
        except httpx.HTTPError as exc:
            return ProbeResult(rec.id, ok=False, error=_describe(exc))
        if resp.status_code != 200:
            return ProbeResult(rec.id, ok=False, error=f"HTTP {resp.status_code}")
        if loading:
            return ProbeResult(rec.id, ok=True)
        # Health passed: a replica is not unhealthy for want of metrics; the autoscaler holds instead.
        ongoing = None
        try:
            metrics = await self.client.get(base + rec.probes.metrics)
        except httpx.HTTPError as exc:
            logger.debug("replica %s: metrics unreadable: %s", rec.id, exc)
        else:
            load = parse_vllm_metrics(metrics.text) if metrics.status_code == 200 else None
            ongoing = load.ongoing if load is not None else None
            if ongoing is None:
                logger.debug("replica %s: no request gauges on %s", rec.id, rec.probes.metrics)
        return ProbeResult(rec.id, ok=True, ongoing=ongoing)

    # --- update

    def _next_state(self, rec: ReplicaRecord, probe: ProbeResult) -> tuple[ReplicaState, str]:
        verdict = judge(
            self.config.health_rule,
            rec.state,
            rec.message,
            ok=probe.ok,
            error=probe.error,
            streak=self._streaks.get(rec.id, Streak()),
        )
        self._streaks[rec.id] = verdict.streak
        return verdict.state, verdict.message

    def _update(
        self, replicas: list[ReplicaRecord], probes: dict[str, ProbeResult], report: PassReport
    ) -> list[ReplicaRecord]:
        out: list[ReplicaRecord] = []
        for rec in replicas:
            probe = probes.get(rec.id)
            if probe is None:
                out.append(rec)
                continue
            state, message = self._next_state(rec, probe)
            if (state, message) == (rec.state, rec.message):
                out.append(rec)
                continue
            # The store has no compare-and-set: re-read just before writing, and leave a record that
            # changed since the pass read it (a deploy, an undeploy) to that writer. The window left is
            # one round trip, and the next pass corrects whatever falls into it.
            fresh = self.store.get_replica(rec.id)
            if fresh is None or (fresh.state, fresh.updated_at) != (rec.state, rec.updated_at):
                if fresh is not None:
                    out.append(fresh)
                continue
            new = rec.model_copy(update={"state": state, "message": message, "updated_at": self.clock()})
            self.store.put_replica(new)
            report.changed.append(rec.id)
            log = logger.warning if state is ReplicaState.UNHEALTHY else logger.info
            log("replica %s: %s -> %s %s", rec.id, rec.state.value, state.value, message)
            out.append(new)
        known = {r.id for r in replicas}
        for rid in [k for k in self._streaks if k not in known]:
            del self._streaks[rid]
        return out

    # --- state series (sarv_deployment_*, sarv_node_*)

    def _export_state(self, deployments: list[DeploymentRecord], replicas: list[ReplicaRecord]) -> None:
        """Set the deployment and node series from this pass's records; drop the label sets now gone."""
        m = self.metrics
        names = {d.name for d in deployments}
        for gone in self._exported - names:
            for state in _DEPLOYMENT_STATES:
                with suppress(KeyError):
                    m.deployment_replicas.remove(gone, state)
        self._exported = names
        m.unplaced.clear()  # reasons come and go with the pending replicas
        for dep in deployments:
            mine = [r for r in replicas if r.deployment == dep.name]
            counts = deployment_counts(dep, mine)
            for state, value in counts.items():
                m.deployment_replicas.labels(dep.name, state).set(value)
            for reason, n in _pending_reasons(mine).items():
                m.unplaced.labels(dep.name, reason).set(n)
        if self.fleet is None:
            return
        held: dict[tuple[str, int], bool] = {}
        for rec in replicas:
            for shard in rec.shards:
                for index in shard.gpus:
                    held[(shard.node, index)] = True
        cordoned = {n.name for n in self.store.list_nodes() if not n.schedulable}
        for node in self.fleet.nodes:
            m.node_schedulable.labels(node.name).set(0 if node.name in cordoned else 1)
            by_type: dict[str, list[int]] = {}
            for gpu in node.gpus:
                by_type.setdefault(gpu.model, [0, 0])[0 if (node.name, gpu.index) in held else 1] += 1
            for gpu_type, (allocated, free) in by_type.items():
                m.node_gpus.labels(node.name, gpu_type, "allocated").set(allocated)
                m.node_gpus.labels(node.name, gpu_type, "free").set(free)

    # --- autoscale

    def _autoscale(
        self,
        deployments: list[DeploymentRecord],
        replicas: list[ReplicaRecord],
        probes: dict[str, ProbeResult],
    ) -> dict[str, Decision]:
        decisions: dict[str, Decision] = {}
        now = self.monotonic()
        for dep in deployments:
            policy = self.config.policy_for(dep.name)
            low, high = policy.bounds(dep.spec.replicas)
            loads = tuple(
                _replica_load(r, probes.get(r.id))
                for r in replicas
                if r.deployment == dep.name and r.state in _COUNTED
            )
            ctx = AutoscaleContext(dep.name, policy, low, high, loads, now)
            previous = self._policy.get(dep.name, PolicyState())
            decision, self._policy[dep.name] = decide(ctx, previous)
            decisions[dep.name] = decision
            self.metrics.recommended.labels(dep.name).set(decision.recommended)
            self.metrics.current.labels(dep.name).set(decision.current)
            if decision.load is not None:
                self.metrics.load.labels(dep.name).set(decision.load)
            if decision.recommended != decision.current:
                # Applying is left to the operator (or a later controller): the deploy orchestration has
                # no call that changes a deployment's replica count in place.
                logger.info(
                    "deployment %s: recommend %d replica(s), %d run: %s",
                    dep.name,
                    decision.recommended,
                    decision.current,
                    decision.reason,
                )
        gone = [name for name in self._policy if name not in decisions]
        for name in gone:
            del self._policy[name]
            for gauge in (self.metrics.recommended, self.metrics.current, self.metrics.load):
                # KeyError: never set (e.g. the load of a deployment that was never measured).
                with suppress(KeyError):
                    gauge.remove(name)
        return decisions

    # --- loop

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass, one every ``period_s``, until ``stop`` is set (SIGTERM/SIGINT in the CLI)."""
        while not stop.is_set():
            started = self.monotonic()
            await self.run_once()
            wait = max(0.0, self.config.period_s - (self.monotonic() - started))
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=wait)

    def release(self) -> None:
        """Give the lease up (clean shutdown), so a standby takes over now instead of at expiry."""
        if self.lease is not None and self._was_leader:
            try:
                self.lease.release()
            except SarvError:
                logger.exception("could not release the controller lease; it expires on its own")
        self._was_leader = False
        self.metrics.leader.set(0)


_COUNTED = frozenset(
    {ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY, ReplicaState.UNHEALTHY}
)


_DEPLOYMENT_STATES = ("desired", "current", "ready", "loading", "pending")


def deployment_counts(dep: DeploymentRecord, replicas: list[ReplicaRecord]) -> dict[str, int]:
    """``sarv_deployment_replicas`` of one deployment: desired; current (placed and not leaving, loading
    included); ready; loading (starting); pending (asked for, not placed)."""
    leaving = {ReplicaState.DRAINING, ReplicaState.STOPPING, ReplicaState.PENDING}
    return {
        "desired": dep.spec.replicas,
        "current": sum(1 for r in replicas if r.state not in leaving),
        "ready": sum(1 for r in replicas if r.state is ReplicaState.READY),
        "loading": sum(1 for r in replicas if r.state is ReplicaState.STARTING),
        "pending": sum(1 for r in replicas if r.state is ReplicaState.PENDING),
    }


def _pending_reasons(replicas: list[ReplicaRecord]) -> dict[str, int]:
    """Pending replicas by reason: the message's head before ``:`` as a label (``no room`` → ``no_room``)."""
    out: dict[str, int] = {}
    for rec in replicas:
        if rec.state is ReplicaState.PENDING:
            head = rec.message.partition(":")[0].strip().lower() or "pending"
            reason = "".join(c if c.isalnum() else "_" for c in head)[:32]
            out[reason] = out.get(reason, 0) + 1
    return out


def _replica_load(rec: ReplicaRecord, probe: ProbeResult | None) -> ReplicaLoad:
    if rec.state in {ReplicaState.PENDING, ReplicaState.STARTING}:
        return ReplicaLoad(rec.id, loading=True)
    if rec.state is ReplicaState.UNHEALTHY:
        # The gateway routes nothing to an unhealthy replica: its load is known, and it is zero.
        return ReplicaLoad(rec.id, ongoing=0.0)
    return ReplicaLoad(rec.id, ongoing=probe.ongoing if probe is not None else None)


def _describe(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
