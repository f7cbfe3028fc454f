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
    Direction,
    PolicyState,
    ReplicaLoad,
    decide,
)
from controlplane.controller.healing import (
    CrashRecord,
    HealingConfig,
    NodeWatch,
    crash_seen,
    node_seen,
    restart_due,
)
from controlplane.controller.health import PROBED_STATES, HealthRule, Streak, judge, probe_path
from controlplane.controller.idle import ZeroScaler
from controlplane.controller.rollout_policy import RolloutPolicy, RolloutState
from controlplane.engines.metrics import (
    QUEUE_TIME,
    TTFT,
    HistogramSample,
    parse_histogram,
    parse_vllm_metrics,
)
from controlplane.errors import ConfigError, PlacementError, SarvError, describe_validation_error
from controlplane.launchers.base import ProcessState, ReplicaProcess
from controlplane.spec import DeploymentRecord, Fleet, ReplicaRecord, ReplicaState

if TYPE_CHECKING:
    import httpx
    from prometheus_client import CollectorRegistry

    from controlplane.controller.deploy import Deployer
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
    gateway_metrics: list[str] = Field(default_factory=list, max_length=64)
    """``/metrics`` URLs of the gateways' metrics listeners (``gateway_metrics_host:port``, not the API
    port), whose ``sarv_gateway_queue_seconds`` joins the queue-wait signal (the gateway queues a request
    before any replica sees it)."""
    gateway_metrics_token_file: Path | None = None
    """The bearer token those listeners require (the gateways' ``gateway_metrics_token_file``), if any;
    read on every pass, so a rotated token is picked up."""
    act: bool = True
    """Apply the autoscaler's decisions and heal replicas (where the controller can reach the launchers);
    False only recommends, as before."""
    unplaced_backoff_s: float = Field(default=30.0, gt=0, le=86_400)
    """After a scale-up the planner could not place, the first wait before trying again (doubling up to
    ``unplaced_backoff_max_s``)."""
    unplaced_backoff_max_s: float = Field(default=600.0, gt=0, le=86_400)
    drain_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """How long a scale-down lets a removed replica's in-flight requests finish before stopping it."""
    healing: HealingConfig = Field(default_factory=HealingConfig)
    """Restart back-off, crash loops and the node grace period."""
    wake_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """Limit of one ``POST /sleep`` or ``/wake_up`` (scale to zero), and how long passes run every
    0.2 s while a deployment wakes from zero."""
    rollout: RolloutPolicy = Field(default_factory=RolloutPolicy)
    """How canaries are judged (window, TTFT and error thresholds) and whether steps promote alone."""

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


_EVENT_REASONS = (
    "Scaled",
    "Restarted",
    "Rescheduled",
    "NodeBack",
    "CrashLoop",
    "RestartFailed",
    "NodeLost",
    "NoRoom",
    "ScaledToZero",
    "Woken",
    "WakeFailed",
    "RolloutPromoted",
    "RolloutSucceeded",
    "RollingBack",
    "RolledBack",
)
"""Reasons of the events the controller records itself (either type, as the situation says)."""


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
        self.decisions = Counter(
            "sarv_autoscaler_decisions",
            "Scaling decisions the controller applied, by deployment and direction (up|down).",
            ["deployment", "direction"],
            registry=r,
        )
        self.queue_wait = Gauge(
            "sarv_controller_queue_wait_seconds",
            "The autoscaler's queue-wait quantile over its window (replicas or gateway, the larger).",
            ["deployment"],
            registry=r,
        )
        self.restarts = Counter(
            "sarv_controller_replica_restarts",
            "Replicas the controller started again after a crash or a lost node, by reason.",
            ["deployment", "reason"],
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
        # Every reason the controller records, at 0 from the start: increase() then sees the first event
        # (a series born at 1 has no increase for Prometheus).
        for reason in _EVENT_REASONS:
            for kind in ("Normal", "Warning"):
                self.events.labels(reason, kind)
        self.node_gpus = Gauge(
            "sarv_node_gpus",
            "GPUs of a node by state: allocated (held by a replica) or free.",
            ["node", "gpu_type", "state"],
            registry=r,
        )
        self.rollout_weight = Gauge(
            "sarv_rollout_canary_weight_percent",
            "Share of the deployment's traffic its rollout's canary takes (0 while rolling back).",
            ["deployment"],
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
    kv_cache_usage: float | None = None
    queue: HistogramSample | None = None
    """Its ``vllm:request_queue_time_seconds`` histogram (cumulative)."""
    ttft: HistogramSample | None = None
    """Its ``vllm:time_to_first_token_seconds`` histogram (cumulative): a rollout's TTFT signal."""


@dataclass
class PassReport:
    """What one pass did; returned by :meth:`Reconciler.run_once` for logs and tests."""

    leader: bool = False
    probed: int = 0
    changed: list[str] = field(default_factory=list)
    """Replica ids whose state this pass changed."""
    targets_written: bool = False
    decisions: dict[str, Decision] = field(default_factory=dict)
    scaled: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Deployments this pass scaled: (from, to)."""
    restarted: list[str] = field(default_factory=list)
    """Replicas this pass started again (crash, lost node)."""
    rollouts: dict[str, str] = field(default_factory=dict)
    """Deployments with an active rollout: this pass's decision (hold, promote, rollback)."""
    failed_phases: list[str] = field(default_factory=list)
    zeroed: list[str] = field(default_factory=list)
    """Deployments this pass took to zero (scale to zero)."""
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
    fleet: Fleet | None = None
    """The fleet, for the per-node GPU and schedulable series; None exports none of them."""
    clock: Callable[[], float] = time.time
    """Wall clock for ``updated_at``."""
    monotonic: Callable[[], float] = time.monotonic
    """Clock of the autoscaling delays and of phase durations."""
    deployer: Deployer | None = None
    """Acts: scales deployments and restarts replicas (None: recommends only, probes over HTTP)."""
    _streaks: dict[str, Streak] = field(default_factory=dict)
    _policy: dict[str, PolicyState] = field(default_factory=dict)
    _was_leader: bool = False
    _crashes: dict[str, CrashRecord] = field(default_factory=dict)
    _seen_restarts: dict[str, int] = field(default_factory=dict)
    _nodes: dict[str, NodeWatch] = field(default_factory=dict)
    _orphans: dict[str, list[ReplicaRecord]] = field(default_factory=dict)
    """Replicas moved off a lost node whose process could not be stopped: stopped once it answers."""
    _unplaced: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Deployment → (retry at, last back-off) after a scale-up the planner could not place."""
    _exported: set[str] = field(default_factory=set)
    _stale_marks: set[tuple[str, str]] = field(default_factory=set)
    """(deployment, controller) launch marks already said to be ignored (see ``_managed``)."""
    """Deployments whose ``sarv_deployment_replicas`` series this controller has set."""
    _zero: ZeroScaler | None = None

    @property
    def zero(self) -> ZeroScaler:
        """Scale to zero: idleness, sleep or stop, wake (controller/idle.py)."""
        if self._zero is None:
            self._zero = ZeroScaler(self)
        return self._zero

    _rollouts: dict[str, RolloutState] = field(default_factory=dict)
    """The rollout policy's window per deployment under rollout."""

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
        self._crashes.clear()
        self._seen_restarts.clear()
        self._nodes.clear()
        self._unplaced.clear()
        self.zero.forget()
        self._rollouts.clear()

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
        acting = self.config.act and self.deployer is not None
        if self.deployer is not None and self.lease is not None:
            self.deployer.marker = self.lease.holder  # its scales' launch marks name this controller
        managed = self._managed(deployments)
        if acting:
            with self._phase("wake", report):
                if await self.zero.wake(managed, replicas):
                    replicas = self.store.list_replicas()
                    deployments = self.store.list_deployments()
                    managed = self._managed(deployments)

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

        if acting:
            with self._phase("heal", report):
                replicas = await self._heal(managed, replicas, probes, report)

        if self._still_leader():
            await self._act(managed, replicas, probes, report, acting=acting)

    def _managed(self, deployments: list[DeploymentRecord]) -> list[DeploymentRecord]:
        """The deployments this pass may act on: not those a deploy or scale is still launching
        (``DeploymentRecord.launching_until``); their replicas are probed and their state kept current. The
        mark of a scale by another controller (``launching_by``, its lease holder id) is not: that controller
        lost the lease, so its launch ended with it, and this one takes the deployment over at once."""
        now = self.clock()
        holder = self.lease.holder if self.lease is not None else ""
        leading = self.lease is None or self._was_leader  # a standby leaves the leader's marks alone
        launching: set[str] = set()
        for d in deployments:
            if d.launching_until <= now:
                continue
            if leading and d.launching_by and d.launching_by != holder:
                if (d.name, d.launching_by) in self._stale_marks:
                    continue
                self._stale_marks.add((d.name, d.launching_by))
                logger.info(
                    "deployment %s: controller %s marked it as launching and no longer holds the lease; "
                    "its mark is ignored",
                    d.name,
                    d.launching_by,
                )
                continue
            launching.add(d.name)
        if not launching:
            return deployments
        logger.debug("being launched, left alone this pass: %s", ", ".join(sorted(launching)))
        return [d for d in deployments if d.name not in launching]

    async def _act(
        self,
        deployments: list[DeploymentRecord],
        replicas: list[ReplicaRecord],
        probes: dict[str, ProbeResult],
        report: PassReport,
        *,
        acting: bool,
    ) -> None:
        """The pass's decisions on the probed state: autoscale, rollouts, scale, scale to zero."""
        pages: list[tuple[str, str]] = []
        gateway: dict[str, tuple[tuple[str, HistogramSample], ...]] = {}
        serving = self.zero.active(deployments)
        with self._phase("autoscale", report):
            pages = await self._gateway_pages()
            gateway = self._gateway_queues([d.name for d in deployments], pages)
            report.decisions = self._autoscale(serving, replicas, probes, gateway)
        if acting and self._still_leader():
            with self._phase("rollout", report):
                await self._rollout(replicas, probes, pages, report)
        if acting and self._still_leader():
            with self._phase("scale", report):
                # A deployment under rollout changes its replicas through the rollout alone.
                await self._apply([d for d in serving if d.name not in report.rollouts], replicas, report)
        if self._still_leader():
            with self._phase("idle", report):
                report.zeroed = await self.zero.settle(deployments, replicas, probes, gateway, acting=acting)

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
        # Each deployment's engine key: the ready probe of a loading replica is on /v1/*.
        keys = {}
        for name in sorted({r.deployment for r in todo}):
            keys[name] = await asyncio.to_thread(self.store.get_engine_key, name)
        results = await asyncio.gather(
            *(self._bounded(self._probe(r, keys.get(r.deployment)), r.id) for r in todo)
        )
        return {p.replica_id: p for p in results}

    async def _bounded(self, probe: Awaitable[ProbeResult], replica_id: str) -> ProbeResult:
        # httpx's timeout bounds each socket operation, not a whole response trickled byte by byte.
        try:
            return await asyncio.wait_for(probe, timeout=self.config.probe_timeout_s)
        except TimeoutError:
            return ProbeResult(replica_id, ok=False, error=f"no answer within {self.config.probe_timeout_s}s")

    async def _probe(self, rec: ReplicaRecord, api_key: SecretStr | None = None) -> ProbeResult:
        import httpx

        base = rec.endpoint or ""
        loading = rec.state is ReplicaState.STARTING
        headers = {}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key.get_secret_value()}"
        try:
            resp = await self.client.get(base + probe_path(rec), headers=headers)
        except httpx.HTTPError as exc:
            return ProbeResult(rec.id, ok=False, error=_describe(exc))
        if resp.status_code != 200:
            return ProbeResult(rec.id, ok=False, error=f"HTTP {resp.status_code}")
        if loading:
            return ProbeResult(rec.id, ok=True)
        # Health passed: a replica is not unhealthy for want of metrics; the autoscaler holds instead.
        try:
            metrics = await self.client.get(base + rec.probes.metrics)
        except httpx.HTTPError as exc:
            logger.debug("replica %s: metrics unreadable: %s", rec.id, exc)
            return ProbeResult(rec.id, ok=True)
        text = metrics.text if metrics.status_code == 200 else ""
        load = parse_vllm_metrics(text)
        if load is None or load.ongoing is None:
            logger.debug("replica %s: no request gauges on %s", rec.id, rec.probes.metrics)
            return ProbeResult(rec.id, ok=True)
        queue = parse_histogram(text, QUEUE_TIME)
        return ProbeResult(
            rec.id,
            ok=True,
            ongoing=load.ongoing,
            kv_cache_usage=load.kv_cache_usage,
            queue=queue,
            ttft=parse_histogram(text, TTFT),
        )

    async def _gateway_pages(self) -> list[tuple[str, str]]:
        """Each gateway's metrics page, by URL; "" for a gateway that does not answer (logged)."""
        import httpx

        headers = {}
        token_file = self.config.gateway_metrics_token_file
        if token_file is not None:
            try:
                headers["Authorization"] = f"Bearer {token_file.read_text().strip()}"
            except OSError as exc:
                logger.warning(
                    "cannot read the gateway metrics token %s: %s", token_file, exc.strerror or exc
                )

        async def one(url: str) -> tuple[str, str]:
            try:
                get = self.client.get(url, headers=headers)
                resp = await asyncio.wait_for(get, timeout=self.config.probe_timeout_s)
            except (httpx.HTTPError, TimeoutError) as exc:
                logger.warning("gateway metrics %s unreadable: %s", url, _describe(exc))
                return url, ""
            return url, resp.text if resp.status_code == 200 else ""

        return list(await asyncio.gather(*(one(u) for u in self.config.gateway_metrics)))

    def _gateway_queues(
        self, models: list[str], pages: list[tuple[str, str]]
    ) -> dict[str, tuple[tuple[str, HistogramSample], ...]]:
        """Each model's ``sarv_gateway_queue_seconds`` histogram, by gateway; a gateway that does not
        answer is left out (its queue is unknown, not empty)."""
        out: dict[str, tuple[tuple[str, HistogramSample], ...]] = {}
        for model in models:
            found = []
            for url, text in pages:
                histogram = parse_histogram(text, "sarv_gateway_queue_seconds", {"model": model})
                if histogram is not None:
                    found.append((url, histogram))
            out[model] = tuple(found)
        return out

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
        gateway: dict[str, tuple[tuple[str, HistogramSample], ...]],
    ) -> dict[str, Decision]:
        decisions: dict[str, Decision] = {}
        now = self.monotonic()
        for dep in deployments:
            policy = self.config.policy_for(dep.name)
            low, high = policy.bounds(dep.spec.replicas, dep.spec.min_replicas, dep.spec.max_replicas)
            low = max(1, low)  # below one replica is scale to zero's (idle.py), never a load decision
            loads = tuple(
                _replica_load(r, probes.get(r.id))
                for r in replicas
                if r.deployment == dep.name and r.state in _COUNTED
            )
            ctx = AutoscaleContext(dep.name, policy, low, high, loads, now, gateway.get(dep.name, ()))
            previous = self._policy.get(dep.name, PolicyState())
            decision, self._policy[dep.name] = decide(ctx, previous)
            decisions[dep.name] = decision
            if low < high:
                # A deployment that can scale has both directions at 0 from the start: increase() then
                # sees its first decision (a series born at 1 has no increase for Prometheus).
                for direction in (Direction.UP, Direction.DOWN):
                    self.metrics.decisions.labels(dep.name, direction.value)
            self.metrics.recommended.labels(dep.name).set(decision.recommended)
            self.metrics.current.labels(dep.name).set(decision.current)
            if decision.load is not None:
                self.metrics.load.labels(dep.name).set(decision.load)
            if decision.signals.queue_wait_s is not None:
                self.metrics.queue_wait.labels(dep.name).set(decision.signals.queue_wait_s)
            if decision.recommended != decision.current:
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
            self._unplaced.pop(name, None)
            for gauge in (
                self.metrics.recommended,
                self.metrics.current,
                self.metrics.load,
                self.metrics.queue_wait,
            ):
                # KeyError: never set (e.g. the load of a deployment that was never measured).
                with suppress(KeyError):
                    gauge.remove(name)
            for direction in (Direction.UP, Direction.DOWN):
                with suppress(KeyError):
                    self.metrics.decisions.remove(name, direction.value)
        return decisions

    # --- act: rollouts

    async def _rollout(
        self,
        replicas: list[ReplicaRecord],
        probes: dict[str, ProbeResult],
        pages: list[tuple[str, str]],
        report: PassReport,
    ) -> None:
        """Drive each active rollout one change and one judgement on (``controller.rollout``)."""
        from controlplane.controller.rollout import drive, sample_of

        deployer = self.deployer
        assert deployer is not None
        active = [r for r in self.store.list_rollouts() if r.active]
        ttft = {rid: p.ttft for rid, p in probes.items()}
        now = self.monotonic()
        for rollout in active:
            name = rollout.deployment
            report.rollouts[name] = "hold"
            sample = sample_of(now, rollout, replicas, ttft, pages)
            try:
                state, decision = await asyncio.to_thread(
                    drive,
                    deployer,
                    name,
                    sample=sample,
                    state=self._rollouts.get(name, RolloutState()),
                    policy=self.config.rollout,
                    now=now,
                    drain_timeout=self.config.drain_timeout_s,
                    metrics=self.metrics,
                )
            except SarvError as exc:
                logger.warning("rollout of %s: %s", name, exc.message)
                continue
            self._rollouts[name] = state
            if decision is not None:
                report.rollouts[name] = decision.action.value
            after = self.store.get_rollout(name)
            self.metrics.rollout_weight.labels(name).set(after.weight if after is not None else 0)
        for name in [n for n in self._rollouts if n not in {r.deployment for r in active}]:
            del self._rollouts[name]
            with suppress(KeyError):
                self.metrics.rollout_weight.remove(name)

    # --- act: scale

    async def _apply(
        self, deployments: list[DeploymentRecord], replicas: list[ReplicaRecord], report: PassReport
    ) -> None:
        """Apply each deployment's decision through ``scale``: one change per deployment per pass (the
        policy bounds its step). Replicas the planner could not place wait as ``pending``; placing them
        is tried again after a back-off (doubling), never in a tight loop."""
        from controlplane.controller.scaling import NO_ROOM

        now = self.monotonic()
        for dep in deployments:
            decision = report.decisions.get(dep.name)
            pending = sum(
                1
                for r in replicas
                if r.deployment == dep.name
                and r.state is ReplicaState.PENDING
                and r.message.startswith(NO_ROOM)
            )
            retry = self._unplaced.get(dep.name)
            backing_off = retry is not None and now < retry[0]
            direction = decision.direction if decision is not None else Direction.NONE
            if decision is not None and (
                direction is Direction.DOWN or (direction is Direction.UP and not backing_off)
            ):
                reason = f"scaled from {decision.current} to {decision.recommended}: {decision.reason}"
                await self._scale(dep, decision.recommended, reason, report)
            elif pending and not backing_off:
                why = f"placing {pending} pending replica(s) again"
                await self._scale(dep, dep.spec.replicas, why, report, retry_only=True)
            elif backing_off and retry is not None and direction is Direction.UP:
                logger.info(
                    "deployment %s: scale-up backs off %.0fs more (no room)", dep.name, retry[0] - now
                )

    async def _scale(
        self,
        dep: DeploymentRecord,
        replicas: int,
        reason: str,
        report: PassReport,
        *,
        retry_only: bool = False,
    ) -> None:
        from controlplane.controller.scaling import scale

        deployer = self.deployer
        assert deployer is not None
        result = await asyncio.to_thread(
            scale,
            deployer,
            dep.name,
            replicas,
            reason=reason,
            source="controller",
            wait=False,
            drain_timeout=self.config.drain_timeout_s,
            metrics=self.metrics,
        )
        now = self.monotonic()
        if result.unplaced:
            retry = self._unplaced.get(dep.name)
            wait = self._next_backoff(retry)
            self._unplaced[dep.name] = (now + wait, wait)
            logger.warning(
                "deployment %s: %d replica(s) pending (%s); placing them again in %.0fs",
                dep.name,
                result.unplaced,
                result.reason,
                wait,
            )
        else:
            self._unplaced.pop(dep.name, None)
        if not retry_only and result.after != result.before:
            direction = Direction.UP if result.after > result.before else Direction.DOWN
            self.metrics.decisions.labels(dep.name, direction.value).inc()
            report.scaled[dep.name] = (result.before, result.after)
            # The window so far was measured on the old replica set: the policy starts a new run.
            self._policy[dep.name] = PolicyState()

    def _next_backoff(self, retry: tuple[float, float] | None) -> float:
        if retry is None:
            return self.config.unplaced_backoff_s
        return min(self.config.unplaced_backoff_max_s, retry[1] * 2)

    def _event(
        self,
        reason: str,
        message: str,
        *,
        deployment: str | None = None,
        obj: str = "",
        warning: bool = False,
    ) -> None:
        from controlplane.controller.events import record_event

        record_event(
            self.store,
            reason,
            message,
            object=obj,
            deployment=deployment,
            type="Warning" if warning else "Normal",
            source="controller",
            metrics=self.metrics,
            clock=self.clock,
        )

    # --- act: heal

    async def _heal(
        self,
        deployments: list[DeploymentRecord],
        replicas: list[ReplicaRecord],
        probes: dict[str, ProbeResult],
        report: PassReport,
    ) -> list[ReplicaRecord]:
        """Restart crashed replicas with back-off, stop crash loops, move replicas off lost nodes."""
        known = {d.name for d in deployments}
        from controlplane.controller.deploy import LEAVING_STATES

        todo = [r for r in replicas if r.deployment in known and r.state not in LEAVING_STATES]
        polled = await asyncio.gather(
            *(self._stop_unstarted(r) if _unstarted(r) else self._poll(r) for r in todo)
        )
        polls = {r.id: p for r, p in zip(todo, polled, strict=True)}
        lost = await self._watch_nodes(replicas, probes, polls)
        out: list[ReplicaRecord] = []
        for rec in replicas:
            if rec.id not in polls:
                out.append(rec)
            elif rec.node in lost and not self._crashes.get(rec.id, CrashRecord()).crash_loop:
                out.append(await self._reschedule(rec, lost, report))
            elif _unstarted(rec):
                out.append(await self._start_again(rec, polls[rec.id], report))
            else:
                out.append(await self._heal_one(rec, polls[rec.id], report))
        for rid in [k for k in self._crashes if k not in {r.id for r in out}]:
            del self._crashes[rid]
            self._seen_restarts.pop(rid, None)
        return out

    async def _poll(self, rec: ReplicaRecord) -> ReplicaProcess | SarvError | None:
        """The launcher's view of the replica's process; the error when its node did not answer; None
        when no launcher here reaches it."""
        deployer = self.deployer
        if deployer is None or not rec.handle:
            return None
        try:
            return await asyncio.to_thread(deployer.poll, rec)
        except SarvError as exc:
            return exc

    async def _stop_unstarted(self, rec: ReplicaRecord) -> ReplicaProcess | SarvError | None:
        """Stop whatever runs under the name of ``rec``, a replica whose start never recorded its handle.

        Such a record is written just before the launcher starts the engine; in a deployment this pass
        manages, the launch that wrote it is over (a launch in flight marks its deployment, and this
        controller's own are awaited within its passes): it was killed, and its engine may run on
        unrecorded. Returns what :meth:`_poll` would (its node answered: gone now; or the node's error)."""
        deployer = self.deployer
        if deployer is None:
            return None
        try:
            await asyncio.to_thread(deployer.stop_process, rec)
        except SarvError as exc:
            return exc
        return ReplicaProcess(state=ProcessState.GONE, detail="stopped by name: its start was never recorded")

    async def _start_again(
        self, rec: ReplicaRecord, stopped: ReplicaProcess | SarvError | None, report: PassReport
    ) -> ReplicaRecord:
        """Start ``rec`` again in its slot once :meth:`_stop_unstarted` stopped what ran under its name;
        while its node does not answer, the record stays (the node's grace period then moves it)."""
        if self.deployer is None or not isinstance(stopped, ReplicaProcess):
            return rec
        new = await self._relaunch(rec)
        if new is None:
            # Nothing runs under its name now: without its record the replica is one short, which
            # scaling makes up (with its own back-off), instead of a stop and a failed start every pass.
            left = self.store.get_replica(rec.id)
            if left is not None and _unstarted(left):
                self.store.delete_replica(rec.id)
            return rec
        message = (
            f"{rec.id} was left starting by a launch that ended before recording it; what ran under its "
            "name was stopped and it started again"
        )
        self._restarted(rec, "unfinished-start", message, report)
        return new

    async def _relaunch(self, rec: ReplicaRecord) -> ReplicaRecord | None:
        """``Deployer.relaunch`` of ``rec`` (its slot, not awaited); None when it failed (event
        ``RestartFailed``)."""
        deployer = self.deployer
        assert deployer is not None
        try:
            return await asyncio.to_thread(deployer.relaunch, rec.deployment, rec.index)
        except SarvError as exc:
            self._event(
                "RestartFailed",
                f"{rec.id}: {exc.message}",
                deployment=rec.deployment,
                obj=f"replica/{rec.id}",
                warning=True,
            )
            return None

    def _restarted(self, rec: ReplicaRecord, reason: str, message: str, report: PassReport) -> None:
        """Count and tell a restart (``sarv_controller_replica_restarts`` by ``reason``; event Restarted)."""
        self.metrics.restarts.labels(rec.deployment, reason).inc()
        report.restarted.append(rec.id)
        self._event("Restarted", message, deployment=rec.deployment, obj=f"replica/{rec.id}", warning=True)

    async def _heal_one(
        self, rec: ReplicaRecord, proc: ReplicaProcess | SarvError | None, report: PassReport
    ) -> ReplicaRecord:
        if not isinstance(proc, ReplicaProcess):
            return rec
        cfg = self.config.healing
        now = self.monotonic()
        record = self._crashes.get(rec.id, CrashRecord())
        supervised = max(0, proc.restarts - self._seen_restarts.get(rec.id, 0))
        self._seen_restarts[rec.id] = proc.restarts
        running = proc.state is ProcessState.RUNNING
        if record.crash_loop or (running and not supervised):
            return rec
        if not running and record.restart_at is None:
            # A new crash: the process is gone, or the launcher's own restarts ran out.
            record = crash_seen(cfg, record, now, max(1, supervised))
        elif supervised:
            # The launcher's supervisor restarted it: each of those restarts is a crash that counts.
            counted = crash_seen(cfg, record, now, supervised)
            record = counted if not running else CrashRecord(counted.crashes, None, counted.crash_loop)
        self._crashes[rec.id] = record
        if record.crash_loop:
            return await self._give_up(rec, record, proc.exit_code)
        if running:
            return rec
        if restart_due(record, now):
            return await self._restart(rec, record, proc.exit_code, report)
        return self._owed(rec, record, proc.exit_code, now)

    def _owed(self, rec: ReplicaRecord, record: CrashRecord, code: int | None, now: float) -> ReplicaRecord:
        """``rec`` marked failed with the restart it is owed (once: the countdown is not rewritten)."""
        if rec.state is ReplicaState.FAILED and rec.message.startswith("exited"):
            return rec
        exit_code = f" with code {code}" if code is not None else ""
        wait = max(0.0, (record.restart_at or now) - now)
        return self._put(
            rec, ReplicaState.FAILED, f"exited{exit_code}; restart {record.count} in {wait:.0f}s"
        )

    def _put(self, rec: ReplicaRecord, state: ReplicaState, message: str) -> ReplicaRecord:
        new = rec.model_copy(update={"state": state, "message": message, "updated_at": self.clock()})
        self.store.put_replica(new)
        return new

    async def _restart(
        self, rec: ReplicaRecord, record: CrashRecord, code: int | None, report: PassReport
    ) -> ReplicaRecord:
        exit_code = f" (exit code {code})" if code is not None else ""
        new = await self._relaunch(rec)
        if new is None:
            self._crashes[rec.id] = crash_seen(self.config.healing, record, self.monotonic())
            return rec
        self._seen_restarts[rec.id] = 0
        self._crashes[rec.id] = CrashRecord(record.crashes)
        message = (
            f"{rec.id} crashed{exit_code}; started again (crash {record.count} in "
            f"{self.config.healing.crash_loop_window_s:.0f} s)"
        )
        self._restarted(rec, "crash", message, report)
        return new

    async def _give_up(self, rec: ReplicaRecord, record: CrashRecord, code: int | None) -> ReplicaRecord:
        deployer = self.deployer
        assert deployer is not None
        if rec.state is ReplicaState.FAILED and rec.message.startswith("crash loop"):
            return rec
        with suppress(SarvError):
            await asyncio.to_thread(deployer.stop_process, rec)
        cfg = self.config.healing
        exit_code = f", last exit code {code}" if code is not None else ""
        message = (
            f"crash loop: {record.count} crashes in {cfg.crash_loop_window_s:.0f} s{exit_code}; "
            f"not restarted (llmctl logs {rec.id}, then llmctl deploy)"
        )
        self._event(
            "CrashLoop",
            f"{rec.id}: {message}",
            deployment=rec.deployment,
            obj=f"replica/{rec.id}",
            warning=True,
        )
        return self._put(rec, ReplicaState.FAILED, message)

    async def _watch_nodes(
        self,
        replicas: list[ReplicaRecord],
        probes: dict[str, ProbeResult],
        polls: dict[str, ReplicaProcess | SarvError | None],
    ) -> frozenset[str]:
        """The nodes silent for longer than the grace period: no replica of theirs answered a probe and
        no launcher got an answer from them (a process that exited is an answer; an SSH timeout is not).

        A node that answers again is a candidate at once; replicas moved off it while it was silent
        whose process could not be stopped then are stopped now, so none runs twice."""
        cfg = self.config.healing
        now = self.monotonic()
        answered: dict[str, bool] = {}
        for rec in replicas:
            probe = probes.get(rec.id)
            poll = polls.get(rec.id)
            heard = (probe is not None and probe.ok) or isinstance(poll, ReplicaProcess)
            if probe is not None or poll is not None:
                answered[rec.node] = answered.get(rec.node, False) or heard
        # A lost node whose replicas all moved away is asked through the processes left on it.
        for node, orphans in self._orphans.items():
            if node not in answered and orphans:
                replies = await asyncio.gather(*(self._poll(o) for o in orphans))
                answered[node] = any(isinstance(p, ReplicaProcess) for p in replies)
        for node, ok in answered.items():
            before = self._nodes.get(node, NodeWatch())
            after = node_seen(cfg, before, now, answered=ok)
            self._nodes[node] = after
            if before.lost and not after.lost:
                await self._node_back(node)
            elif after.lost and not before.lost:
                self._cordon_lost(node)
                self._event(
                    "NodeLost",
                    f"{node} has not answered for {cfg.node_grace_s:.0f} s; its replicas move elsewhere",
                    obj=f"node/{node}",
                    warning=True,
                )
        return frozenset(n for n, w in self._nodes.items() if w.lost)

    def _cordon_lost(self, node: str) -> None:
        """Keep new placements (scale, deploy) off a lost node; an operator's cordon is left as it is."""
        from controlplane.state.base import NodeRecord

        held = self.store.get_node(node)
        if held is None or held.schedulable:
            self.store.put_node(
                NodeRecord(
                    name=node,
                    schedulable=False,
                    reason=f"{LOST_NODE}: not answering",
                    updated_at=self.clock(),
                )
            )

    async def _node_back(self, node: str) -> None:
        deployer = self.deployer
        assert deployer is not None
        held = self.store.get_node(node)
        if held is not None and not held.schedulable and held.reason.startswith(LOST_NODE):
            # Only the controller's own cordon is lifted: an operator's stays.
            self.store.put_node(
                held.model_copy(update={"schedulable": True, "reason": "", "updated_at": self.clock()})
            )
        orphans = self._orphans.pop(node, [])
        for old in orphans:
            with suppress(SarvError):
                await asyncio.to_thread(deployer.stop_process, old)
        stopped = f"; stopped {len(orphans)} replica process(es) moved off it" if orphans else ""
        self._event("NodeBack", f"{node} answers again and takes placements{stopped}", obj=f"node/{node}")

    async def _reschedule(
        self, rec: ReplicaRecord, lost: frozenset[str], report: PassReport
    ) -> ReplicaRecord:
        deployer = self.deployer
        assert deployer is not None
        self._orphans.setdefault(rec.node, []).append(rec)
        try:
            new = await asyncio.to_thread(deployer.relaunch, rec.deployment, rec.index, avoid=lost)
        except PlacementError as exc:
            from controlplane.controller.scaling import NO_ROOM

            self._event(
                "NoRoom",
                f"{rec.id} stays pending: {exc.message}",
                deployment=rec.deployment,
                obj=f"replica/{rec.id}",
                warning=True,
            )
            # A plain pending replica, as scale leaves one: the pending retry places it once there is room,
            # after the back-off (the planner has just said no).
            if rec.deployment not in self._unplaced:
                wait = self._next_backoff(None)
                self._unplaced[rec.deployment] = (self.monotonic() + wait, wait)
            pending = rec.model_copy(
                update={
                    "state": ReplicaState.PENDING,
                    "message": f"{NO_ROOM}: node {rec.node} lost; {exc.message}",
                    "node": "",
                    "shards": [],
                    "handle": {},
                    "endpoint": None,
                    "updated_at": self.clock(),
                }
            )
            self.store.put_replica(pending)
            return pending
        self.metrics.restarts.labels(rec.deployment, "node-lost").inc()
        report.restarted.append(rec.id)
        self._event(
            "Rescheduled",
            f"{rec.id} moved from {rec.node} (not answering) to {new.node}",
            deployment=rec.deployment,
            obj=f"replica/{rec.id}",
            warning=True,
        )
        return new

    # --- loop

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass, one every ``period_s``, until ``stop`` is set (SIGTERM/SIGINT in the CLI)."""
        while not stop.is_set():
            started = self.monotonic()
            await self.run_once()
            wait = max(0.0, self.config.period_s - (self.monotonic() - started))
            # Returns early for a wake request (or while a deployment wakes): held requests wait on it.
            await self.zero.pause(stop, wait)

    def release(self) -> None:
        """Give the lease up (clean shutdown), so a standby takes over now instead of at expiry."""
        if self.lease is not None and self._was_leader:
            try:
                self.lease.release()
            except SarvError:
                logger.exception("could not release the controller lease; it expires on its own")
        self._was_leader = False
        self.metrics.leader.set(0)


LOST_NODE = "lost"
"""Reason prefix of the cordon the controller puts on a node that stopped answering (lifted when it does)."""

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


def _unstarted(rec: ReplicaRecord) -> bool:
    """A replica recorded before its launcher's start returned: starting, placed, and with no handle."""
    return rec.state is ReplicaState.STARTING and not rec.handle and bool(rec.shards)


def _replica_load(rec: ReplicaRecord, probe: ProbeResult | None) -> ReplicaLoad:
    if rec.state in {ReplicaState.PENDING, ReplicaState.STARTING}:
        return ReplicaLoad(rec.id, loading=True)
    if rec.state is ReplicaState.UNHEALTHY:
        # The gateway routes nothing to an unhealthy replica: its load is known, and it is zero.
        return ReplicaLoad(rec.id, ongoing=0.0)
    if probe is None:
        return ReplicaLoad(rec.id)
    return ReplicaLoad(rec.id, ongoing=probe.ongoing, kv_cache_usage=probe.kv_cache_usage, queue=probe.queue)


def _describe(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
