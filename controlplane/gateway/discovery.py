"""Keeps the router's replica set in step with the state store and scrapes each replica's load metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from controlplane.engines.metrics import parse_vllm_metrics
from controlplane.errors import StateError
from controlplane.gateway.hold import Hold
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.routing import ReplicaView, Router
from controlplane.spec import ProbePaths, ReplicaState
from controlplane.state.base import StateStore

__all__ = ["Discovery"]

logger = logging.getLogger(__name__)

_DEFAULT_PROBES = ProbePaths()


class Discovery:
    """Two loops: poll ``store.revision()`` for replica changes, and scrape replica metrics."""

    def __init__(
        self,
        store: StateStore,
        router: Router,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        hold: Hold | None = None,
    ) -> None:
        self._store = store
        self._hold = hold
        """Told the deployments on every change (which models are scaled to zero), and when replicas
        become ready (held requests go on)."""
        self._router = router
        self._session = session
        self._metrics = metrics
        self._now = monotonic
        self._revision: int | None = None
        self._probes: dict[str, ProbePaths] = {}
        """Each routed replica's engine paths, from its record."""
        self.store_ok = False
        self._tried = False
        self._tasks: list[asyncio.Task[None]] = []

    async def refresh(self) -> None:
        """One discovery step: re-read the replicas when the store's revision moved."""
        try:
            rev = await asyncio.to_thread(self._store.revision)
            if rev == self._revision:
                self.store_ok = True
                return
            records = await asyncio.to_thread(self._store.list_replicas)
            deployments = await asyncio.to_thread(self._store.list_deployments) if self._hold else []
            rollouts = await asyncio.to_thread(self._store.list_rollouts)
            names = sorted({r.deployment for r in records if r.state is ReplicaState.READY})
            keys = {n: await asyncio.to_thread(self._store.get_engine_key, n) for n in names}
            self.store_ok = True
        except (StateError, OSError) as exc:
            # Keep routing to the last known replicas: a store outage must not take the API down.
            if not self._tried:
                logger.warning("state store unreachable at start-up (%s); no replicas until it answers", exc)
            elif self.store_ok:
                logger.warning(
                    "state store unreachable (%s); keeping %d known replicas", exc, len(self._router.replicas)
                )
            self.store_ok = False
            return
        finally:
            self._tried = True
        ready = [r for r in records if r.state is ReplicaState.READY and r.endpoint]
        self._probes = {r.id: r.probes for r in ready}
        # Every rollout in progress splits its model's traffic by the canary's weight (0 while rolling back).
        canaries = {r.canary_version: r.weight / 100 for r in rollouts if r.active}
        new = self._router.set_replicas(ready, canaries)
        deployment = {r.id: r.deployment for r in ready}
        for view in self._router.replicas:
            key = keys.get(deployment.get(view.id, ""))
            view.headers = {} if key is None else {"authorization": f"Bearer {key.get_secret_value()}"}
        self._revision = rev
        counts: dict[str, int] = {}
        for r in records:
            counts[r.state.value] = counts.get(r.state.value, 0) + 1
        for state in ReplicaState:
            self._metrics.replicas.labels(state.value).set(counts.get(state.value, 0))
        if new:
            logger.info("replicas now: %s", ", ".join(sorted(v.id for v in self._router.replicas)))
            await asyncio.gather(*(self._learn_context(v) for v in new))
        if self._hold is not None:
            self._hold.update(deployments)

    def _paths(self, view: ReplicaView) -> ProbePaths:
        return self._probes.get(view.id, _DEFAULT_PROBES)

    async def _learn_context(self, view: ReplicaView) -> None:
        # The ready path is the model list; its cards report max_model_len, which prompts are checked against.
        url = view.endpoint + self._paths(view).ready
        try:
            async with self._session.get(
                url, headers=view.headers, timeout=aiohttp.ClientTimeout(total=2.0)
            ) as resp:
                if resp.status != 200:
                    return
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            logger.debug("cannot read %s: %s", url, exc)
            return
        for card in data.get("data", []) if isinstance(data, dict) else []:
            if isinstance(card, dict) and isinstance(card.get("max_model_len"), int):
                view.max_model_len = card["max_model_len"]
                return

    async def scrape(self, view: ReplicaView, timeout: float) -> None:
        try:
            async with self._session.get(
                view.endpoint + self._paths(view).metrics,
                headers=view.headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                if resp.status != 200:
                    return
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return  # stale metrics are ignored by the router; nothing else to do
        load = parse_vllm_metrics(text)
        if load is not None:
            self._router.observe(
                view.id,
                waiting=load.waiting or 0.0,
                running=load.running or 0.0,
                kv=load.kv_cache_usage or 0.0,
            )

    async def _discover_loop(self, interval: float) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # keep the loop alive whatever one step does; it is logged with its traceback
                logger.exception("replica discovery step failed")
            await asyncio.sleep(interval)

    async def _scrape_loop(self, interval: float) -> None:
        while True:
            views = self._router.replicas
            if views:
                try:
                    await asyncio.gather(*(self.scrape(v, interval * 2) for v in views))
                except Exception:  # as above: one bad scrape must not stop the loop
                    logger.exception("metrics scrape failed")
            await asyncio.sleep(interval)

    def start(self, discovery_interval: float, scrape_interval: float) -> None:
        self._tasks = [
            asyncio.create_task(self._discover_loop(discovery_interval), name="sarv-discovery"),
            asyncio.create_task(self._scrape_loop(scrape_interval), name="sarv-scrape"),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
