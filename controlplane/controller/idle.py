"""Scale to zero: an idle deployment's replicas go to sleep (vLLM's sleep mode) or stop, and come back
when a gateway holding requests for it asks (a wake request in the state store).

The idle signal is the requests the deployment served, as the controller already reads them every pass:
each ready replica's ``vllm:request_queue_time_seconds`` count (every request the engine scheduled) and
waiting + running gauges, and the gateways' ``sarv_gateway_queue_seconds{model}`` count (every request a
gateway forwarded). A deployment is idle once neither count has moved and nothing was in flight for its
idle timeout; a replica whose metrics could not be read, or one still loading, restarts the count (an
unknown is never taken for quiet). :func:`idle_seen` is that decision, a pure function of time.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from controlplane.controller.deploy import LEAVING_STATES
from controlplane.errors import SarvError
from controlplane.spec import DeploymentRecord, ReplicaRecord, ReplicaState, ZeroMode

if TYPE_CHECKING:
    from controlplane.controller.reconcile import ProbeResult, Reconciler
    from controlplane.engines.metrics import HistogramSample

__all__ = [
    "SLEEP_LEVEL",
    "Activity",
    "IdleWatch",
    "ZeroScaler",
    "activity_of",
    "idle_seen",
    "sleep_mode_asked",
]

logger = logging.getLogger(__name__)

SLEEP_LEVEL = 1
"""vLLM's sleep level: 1 offloads the weights to host memory (woken in about a second); 2 discards them."""
WAKE_POLL_S = 0.2
"""Between two passes the controller looks for wake requests this often, and runs passes this often
while a deployment wakes, so a held request waits for the engine rather than for the controller."""
SETTLE_S = 1.0
"""After marking replicas asleep, the wait before ``/sleep``: gateways re-read the store every
``discovery_interval_s`` (0.5 s by default), and a request they route meanwhile finds its replica awake."""


@dataclass(frozen=True)
class Activity:
    """What one pass saw of a deployment's requests; None: not known this pass."""

    served: float | None
    """Requests counted so far (cumulative: the replicas' and the gateways' counts together)."""
    ongoing: float | None
    """Waiting + running requests on its replicas now."""


@dataclass(frozen=True)
class IdleWatch:
    """What the idle decision remembers of one deployment between passes."""

    quiet_since: float | None = None
    """Start of the current run without requests (monotonic); None: not watched yet."""
    served: float | None = None
    """The count the run started from."""


def idle_seen(watch: IdleWatch, now: float, activity: Activity, timeout_s: float) -> tuple[IdleWatch, bool]:
    """The watch after this pass, and whether the deployment has now been idle for ``timeout_s``.

    A request in flight, a count that moved (or went down: an engine restarted), or an unknown restarts
    the run; the first pass only starts it."""
    quiet = (
        activity.served is not None
        and activity.ongoing is not None
        and activity.ongoing <= 0
        and watch.quiet_since is not None
        and watch.served == activity.served
    )
    if not quiet or watch.quiet_since is None:
        return IdleWatch(now, activity.served), False
    return watch, now - watch.quiet_since >= timeout_s


def activity_of(
    dep: DeploymentRecord,
    replicas: list[ReplicaRecord],
    probes: dict[str, ProbeResult],
    gateway: tuple[tuple[str, HistogramSample], ...],
) -> Activity:
    """The deployment's :class:`Activity` from this pass's probes and gateway scrapes."""
    mine = [r for r in replicas if r.deployment == dep.name and r.state not in LEAVING_STATES]
    if not mine or any(r.state is not ReplicaState.READY for r in mine):
        return Activity(None, None)  # loading, unhealthy, failed or pending: not a quiet deployment
    served = sum(h.count for _, h in gateway)
    ongoing = 0.0
    for rec in mine:
        probe = probes.get(rec.id)
        if probe is None or not probe.ok or probe.ongoing is None or probe.queue is None:
            return Activity(None, None)
        served += probe.queue.count
        ongoing += probe.ongoing
    return Activity(served, ongoing)


def sleep_mode_asked(dep: DeploymentRecord) -> bool:
    """Whether the deployment's engines run with sleep mode (``engine_args.enable_sleep_mode``); the
    engines then also set ``VLLM_SERVER_DEV_MODE=1``, which serves ``/sleep`` and ``/wake_up``."""
    return dep.spec.engine_args.get("enable_sleep_mode") is True


@dataclass
class ZeroScaler:
    """The controller's scale-to-zero part: watches idleness, takes deployments to zero, wakes them.

    Owned by one :class:`~controlplane.controller.reconcile.Reconciler`, whose store, HTTP client,
    deployer, clocks and events it uses."""

    owner: Reconciler
    wake_poll_s: float = WAKE_POLL_S
    settle_s: float = SETTLE_S
    _watch: dict[str, IdleWatch] = field(default_factory=dict)
    _waking: dict[str, float] = field(default_factory=dict)
    """Deployments being woken → when (monotonic): passes run every ``wake_poll_s`` meanwhile."""

    def forget(self) -> None:
        self._watch.clear()
        self._waking.clear()

    # --- which deployments

    def enabled(self, dep: DeploymentRecord) -> bool:
        asked = dep.spec.scale_to_zero
        return asked if asked is not None else self.owner.config.policy_for(dep.name).scale_to_zero

    def timeout_s(self, dep: DeploymentRecord) -> float:
        own = dep.spec.idle_timeout_s
        return own if own is not None else self.owner.config.policy_for(dep.name).idle_timeout_s

    @staticmethod
    def active(deployments: list[DeploymentRecord]) -> list[DeploymentRecord]:
        """The deployments the autoscaler sizes: not those held at zero (nor waking from it)."""
        return [d for d in deployments if d.zero is None]

    # --- between passes

    async def pause(self, stop: asyncio.Event, wait: float) -> None:
        """Wait ``wait`` seconds, until ``stop``, or until a wake request (or a wake under way) asks for
        the next pass now."""
        store = self.owner.store
        if self._waking:
            wait = min(wait, self.wake_poll_s)
        deadline = self.owner.monotonic() + wait
        while not stop.is_set():
            left = deadline - self.owner.monotonic()
            if left <= 0:
                return
            try:
                if await asyncio.to_thread(store.list_wake_requests):
                    return
            except SarvError as exc:
                logger.warning("cannot read wake requests: %s", exc)
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=min(self.wake_poll_s, left))

    @property
    def waking(self) -> bool:
        return bool(self._waking)

    # --- wake

    async def wake(self, deployments: list[DeploymentRecord], replicas: list[ReplicaRecord]) -> bool:
        """Act on the wake requests: wake sleeping replicas (``POST /wake_up``) or start one. True when
        a replica record changed (the pass re-reads them)."""
        store = self.owner.store
        asked = await asyncio.to_thread(store.list_wake_requests)
        if not asked:
            return False
        by_name = {d.name: d for d in deployments}
        changed = False
        for name in sorted(asked):
            dep = by_name.get(name)
            if dep is not None and dep.zero is not None and name not in self._waking:
                mine = [r for r in replicas if r.deployment == name and r.state not in LEAVING_STATES]
                changed = await self._wake_one(dep, mine) or changed
            await asyncio.to_thread(store.clear_wake_request, name)
        return changed

    async def _wake_one(self, dep: DeploymentRecord, mine: list[ReplicaRecord]) -> bool:
        owner = self.owner
        started = owner.monotonic()
        sleeping = [r for r in mine if r.state is ReplicaState.SLEEPING]
        if any(r.state in {ReplicaState.STARTING, ReplicaState.READY} for r in mine):
            return False  # already on its way back
        if sleeping:
            results = await asyncio.gather(*(self._post(r, "/wake_up") for r in sleeping))
            woken: list[str] = []
            for rec, error in zip(sleeping, results, strict=True):
                if error is None:
                    owner._put(rec, ReplicaState.READY, "")
                    woken.append(rec.id)
                else:
                    owner._event(
                        "WakeFailed",
                        f"{rec.id}: POST /wake_up failed ({error}); started again instead",
                        deployment=dep.name,
                        obj=f"replica/{rec.id}",
                        warning=True,
                    )
                    await self._restart(rec)
            took = owner.monotonic() - started
            if woken:
                owner._event(
                    "Woken",
                    f"woke {', '.join(woken)} from sleep mode in {took:.2f} s for held requests",
                    deployment=dep.name,
                )
                self._ready(dep)
            else:
                self._waking[dep.name] = started
            return True
        # Stopped (or its sleeping replicas are gone): a cold start of the deployment's floor, one or more.
        deployer = owner.deployer
        if deployer is None:
            return False
        from controlplane.controller.scaling import scale

        policy = owner.config.policy_for(dep.name)
        low, _ = policy.bounds(dep.spec.replicas, dep.spec.min_replicas, dep.spec.max_replicas)
        count = max(1, low)
        result = await asyncio.to_thread(
            scale,
            deployer,
            dep.name,
            count,
            reason="woken from zero for held requests",
            source="controller",
            wait=False,
            metrics=owner.metrics,
        )
        self._waking[dep.name] = started
        owner._event(
            "Woken",
            f"started {', '.join(result.added) or 'nothing'} (cold start) for held requests",
            deployment=dep.name,
            warning=not result.added,
        )
        return True

    async def _restart(self, rec: ReplicaRecord) -> None:
        if self.owner.deployer is not None:
            await self.owner._relaunch(rec)  # a failure is told (RestartFailed) and left to healing

    def _ready(self, dep: DeploymentRecord) -> None:
        """The deployment serves again: clear its zero mark, restart its idle run."""
        store = self.owner.store
        fresh = store.get_deployment(dep.name)
        if fresh is not None and fresh.zero is not None:
            store.put_deployment(
                fresh.model_copy(update={"zero": None, "zero_since": 0.0, "updated_at": self.owner.clock()})
            )
        self._waking.pop(dep.name, None)
        self._watch.pop(dep.name, None)

    # --- idle → zero

    async def settle(
        self,
        deployments: list[DeploymentRecord],
        replicas: list[ReplicaRecord],
        probes: dict[str, ProbeResult],
        gateway: dict[str, tuple[tuple[str, HistogramSample], ...]],
        *,
        acting: bool,
    ) -> list[str]:
        """One pass: clear the zero mark of deployments serving again, watch the others' activity and
        take those idle for their timeout to zero (when ``acting``). Returns the deployments taken."""
        now = self.owner.monotonic()
        known = {d.name for d in deployments}
        for gone in [n for n in self._watch if n not in known]:
            del self._watch[gone]
        for name, since in list(self._waking.items()):
            if name not in known or now - since > self.owner.config.wake_timeout_s:
                del self._waking[name]  # back to the usual cadence; healing and the gateway's timeout act
        taken: list[str] = []
        for dep in deployments:
            mine = [r for r in replicas if r.deployment == dep.name and r.state not in LEAVING_STATES]
            if dep.zero is not None:
                if any(r.state is ReplicaState.READY for r in mine):
                    self._ready(dep)  # woken (or scaled, or deployed again by hand)
                continue
            if not self.enabled(dep):
                self._watch.pop(dep.name, None)
                continue
            activity = activity_of(dep, replicas, probes, gateway.get(dep.name, ()))
            before = self._watch.get(dep.name, IdleWatch())
            self._watch[dep.name], idle = idle_seen(before, now, activity, self.timeout_s(dep))
            if idle and acting:
                await self._to_zero(dep, mine, now - (before.quiet_since or now))
                taken.append(dep.name)
        return taken

    async def _to_zero(self, dep: DeploymentRecord, mine: list[ReplicaRecord], idle_s: float) -> None:
        owner = self.owner
        store = owner.store
        self._watch.pop(dep.name, None)
        sleep = sleep_mode_asked(dep)
        fresh = store.get_deployment(dep.name) or dep
        mode = ZeroMode.SLEEP if sleep else ZeroMode.STOP
        store.put_deployment(fresh.model_copy(update={"zero": mode, "zero_since": owner.clock()}))
        why = f"no request for {idle_s:.0f} s (idle_timeout_s {self.timeout_s(dep):.0f})"
        to_stop = list(mine)
        asleep: list[str] = []
        failed: list[str] = []
        if sleep:
            marked = [owner._put(r, ReplicaState.SLEEPING, f"asleep: {why}") for r in mine]
            await asyncio.sleep(self.settle_s)
            results = await asyncio.gather(*(self._post(r, f"/sleep?level={SLEEP_LEVEL}") for r in marked))
            to_stop = []
            for rec, error in zip(marked, results, strict=True):
                if error is None:
                    asleep.append(rec.id)
                else:
                    failed.append(f"{rec.id}: {error}")
                    to_stop.append(rec)
        stopped: list[str] = []
        if to_stop and owner.deployer is not None:
            from controlplane.controller.scaling import drain_replicas

            outcomes = await asyncio.to_thread(
                drain_replicas,
                owner.deployer,
                to_stop,
                timeout=owner.config.drain_timeout_s,
                reason=f"scaled to zero: {why}",
                source="controller",
                metrics=owner.metrics,
            )
            stopped = [o.replica for o in outcomes]
        if not asleep:
            held = store.get_deployment(dep.name)
            if held is not None and held.zero is ZeroMode.SLEEP:
                store.put_deployment(held.model_copy(update={"zero": ZeroMode.STOP}))
        parts = []
        if asleep:
            parts.append(f"{', '.join(asleep)} asleep (sleep mode level {SLEEP_LEVEL}: GPU memory freed)")
        if stopped:
            how = (
                f"sleep mode failed: {'; '.join(failed)}"
                if failed
                else "no sleep mode: engine_args.enable_sleep_mode is off"
            )
            parts.append(f"{', '.join(stopped)} stopped ({how})")
        owner._event(
            "ScaledToZero",
            f"{why}: {'; '.join(parts) or 'no replica'}",
            deployment=dep.name,
            warning=bool(failed),
        )

    async def _post(self, rec: ReplicaRecord, path: str) -> str | None:
        """POST ``path`` on the replica's engine; None on HTTP 200, else what went wrong."""
        import httpx

        key = await asyncio.to_thread(self.owner.store.get_engine_key, rec.deployment)
        headers = {} if key is None else {"Authorization": f"Bearer {key.get_secret_value()}"}
        try:
            resp = await self.owner.client.post(
                (rec.endpoint or "") + path, headers=headers, timeout=self.owner.config.wake_timeout_s
            )
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}".rstrip(": ")
        if resp.status_code == 200:
            return None
        return f"HTTP {resp.status_code} on {path.partition('?')[0]}"
