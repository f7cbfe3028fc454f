"""Requests for a model scaled to zero: held in a bounded queue while the controller wakes a replica.

A model is held for when its deployment is marked at zero by the controller (``DeploymentRecord.zero``),
or asks for scale to zero (``spec.scale_to_zero``), and no ready replica serves it. The first held request
writes a wake request to the state store (again every ``wake_every_s`` while any is held); the controller
acts on it within a fraction of a second. Held requests go on through the usual stages once discovery
routes to a ready replica of the model; past ``max_held_per_model`` or ``hold_timeout_s`` the answer is
503 with ``Retry-After``. A model no deployment serves is still 404 (the request stage says so).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from controlplane.errors import SarvError
from controlplane.gateway.asgi import Receive
from controlplane.gateway.config import HoldConfig
from controlplane.gateway.errors import ApiError
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.routing import Router
from controlplane.spec import DeploymentRecord
from controlplane.state.base import StateStore

__all__ = ["Hold"]

logger = logging.getLogger(__name__)


class Hold:
    """The held requests of one gateway; every method runs on its event loop."""

    def __init__(
        self,
        config: HoldConfig,
        *,
        store: StateStore,
        router: Router,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._store = store
        self._router = router
        self._metrics = metrics
        self._clock = clock
        self._mono = monotonic
        self._zero: dict[str, str] = {}
        """Model (or adapter) name → its scale-to-zero deployment."""
        self._held: dict[str, int] = {}
        self._served: dict[str, asyncio.Event] = {}
        self._askers: dict[str, asyncio.Task[None]] = {}

    # --- what discovery tells

    def update(self, deployments: list[DeploymentRecord]) -> None:
        """The deployments as the store has them; releases the requests of models now served."""
        zero: dict[str, str] = {}
        for dep in deployments:
            if dep.zero is not None or dep.spec.scale_to_zero:
                zero[dep.name] = dep.name
                for adapter in dep.spec.lora_adapters:
                    zero.setdefault(adapter.name, dep.name)
        self._zero = zero
        self.release()

    def release(self) -> None:
        """Wake the held requests of every model a ready replica serves now."""
        for model in [m for m in self._served if self._router.serves(m)]:
            self._served.pop(model).set()

    @property
    def models(self) -> frozenset[str]:
        """Models it would hold requests for (scale-to-zero deployments)."""
        return frozenset(self._zero)

    def holds(self, model: str) -> bool:
        """Whether a request for ``model`` is held rather than routed (or refused as unknown)."""
        return model in self._zero and not self._router.serves(model)

    # --- one request

    async def wait(self, model: str, receive: Receive | None = None) -> None:
        """Hold until ``model`` is served; :class:`ApiError` 503 when the queue is full or the time runs
        out. With ``receive``, a client that leaves gives its place up at once."""
        cfg = self._config
        m = self._metrics
        held = self._held.get(model, 0)
        if held >= cfg.max_held_per_model:
            m.child(m.held_total, model, "full").inc()
            raise ApiError(
                503,
                f"the model '{model}' is scaled to zero and waking; {held} request(s) already wait for it",
                code="model_waking",
                reason="hold_full",
                retry_after=cfg.retry_after_s,
            )
        self._held[model] = held + 1
        m.child(m.held, model).inc()
        self._ask(model)
        served = self._served.setdefault(model, asyncio.Event())
        started = self._mono()
        waiter = asyncio.ensure_future(served.wait())
        watcher = asyncio.ensure_future(receive()) if receive is not None else None
        outcome = "timeout"
        try:
            pending = {waiter} if watcher is None else {waiter, watcher}
            done, _ = await asyncio.wait(
                pending, timeout=cfg.hold_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if waiter in done:
                outcome = "served"
                return
            if watcher is not None and watcher in done:
                outcome = "gone"
                raise ApiError(499, "client went away while its request was held", code="client_disconnected")
            raise ApiError(
                503,
                f"the model '{model}' is scaled to zero and did not wake within {cfg.hold_timeout_s:g}s",
                code="model_waking",
                reason="hold_timeout",
                retry_after=cfg.retry_after_s,
            )
        finally:
            for task in (waiter, watcher):
                if task is not None and not task.done():
                    task.cancel()
            self._held[model] -= 1
            if not self._held[model]:
                del self._held[model]
            m.child(m.held, model).dec()
            m.child(m.held_total, model, outcome).inc()
            m.child(m.hold_seconds, model).observe(self._mono() - started)

    def _ask(self, model: str) -> None:
        """Keep a wake request in the store for the model's deployment while requests are held."""
        deployment = self._zero[model]
        task = self._askers.get(deployment)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._asking(model, deployment))
            self._askers[deployment] = task

    async def _asking(self, model: str, deployment: str) -> None:
        try:
            while self._held.get(model) and not self._router.serves(model):
                try:
                    await asyncio.to_thread(self._store.request_wake, deployment, self._clock())
                except SarvError as exc:
                    logger.warning("cannot ask to wake %s: %s", deployment, exc)
                await asyncio.sleep(self._config.wake_every_s)
        finally:
            self._askers.pop(deployment, None)

    async def close(self) -> None:
        tasks = list(self._askers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
