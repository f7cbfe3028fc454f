"""Usage accounting and the access log: what each request used, recorded off the hot path in batches."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from pydantic_core import to_json

from controlplane.errors import StateError
from controlplane.gateway.config import AccessLogConfig, GatewayConfig
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.upstream import Job
from controlplane.state.base import StateStore, UsageRecord

__all__ = ["AccessLog", "UsageRecorder"]

logger = logging.getLogger(__name__)

_HOUR = 3600

# Cap on the rows kept while the store is unreachable: (hour, key, team, model) combinations, a few hundred
# bytes each. Beyond it the oldest hours are dropped, and the warning says how many rows were lost.
_MAX_ROWS = 100_000


class UsageRecorder:
    """Adds each finished request to an in-memory row per (hour, key, team, model); a background task adds
    the rows to the state store every ``usage_flush_interval_s`` and at shutdown.

    One call per client request (from the app, after retries), so a request the gateway retried on another
    replica counts once. A failed flush keeps its rows for the next one.
    """

    def __init__(
        self,
        store: StateStore,
        config: GatewayConfig,
        *,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._interval = config.usage_flush_interval_s
        self._metrics = metrics
        self._clock = clock
        self._prices = {
            name: (o.prompt_price_per_1k or 0.0, o.completion_price_per_1k or 0.0)
            for name, o in config.models.items()
            if o.prompt_price_per_1k or o.completion_price_per_1k
        }
        # [requests, prompt, completion, errors, rejected, cost]
        self._rows: dict[tuple[int, str, str, str], list[Any]] = {}
        self._task: asyncio.Task[None] | None = None
        self._warned_at = -1e18

    def record(self, job: Job, status: int) -> None:
        """Count one client request of an authenticated key (cheap: a dict lookup and a few additions)."""
        hour = int(self._clock() // _HOUR) * _HOUR
        ident = (hour, job.key, job.team, job.model_label)
        row = self._rows.get(ident)
        if row is None:
            row = self._rows[ident] = [0, 0, 0, 0, 0, 0.0]
        row[0] += 1
        if status == 429:
            row[4] += 1
        elif status >= 400:
            row[3] += 1
        if not job.forwarded:
            return
        prompt, completion = job.usage
        row[1] += prompt
        row[2] += completion
        price = self._prices.get(job.model)
        if price is not None:
            cost = (prompt * price[0] + completion * price[1]) / 1000
            row[5] += cost
            m = self._metrics
            m.child(m.cost, job.model, job.team, job.key).inc(cost)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.flush()

    async def flush(self) -> None:
        """Add the rows counted so far to the store; on failure keep them for the next flush."""
        rows, self._rows = self._rows, {}
        if not rows:
            return
        records = [
            UsageRecord(
                hour=hour,
                key=key,
                team=team,
                model=model,
                requests=r[0],
                prompt_tokens=r[1],
                completion_tokens=r[2],
                errors=r[3],
                rejected=r[4],
                cost=r[5],
            )
            for (hour, key, team, model), r in rows.items()
        ]
        try:
            await asyncio.to_thread(self._store.add_usage, records)
        except StateError as exc:
            for ident, r in rows.items():  # merge back what was counted meanwhile
                row = self._rows.setdefault(ident, [0, 0, 0, 0, 0, 0.0])
                for i, v in enumerate(r):
                    row[i] += v
            lost = 0
            if len(self._rows) > _MAX_ROWS:
                for ident in sorted(self._rows)[: len(self._rows) - _MAX_ROWS]:
                    del self._rows[ident]
                    lost += 1
            now = self._clock()
            if now - self._warned_at >= 60.0 or lost:
                self._warned_at = now
                logger.warning(
                    "cannot record usage (%s); %d rows kept for the next try%s",
                    exc,
                    len(self._rows),
                    f", {lost} oldest dropped" if lost else "",
                )

    async def close(self) -> None:
        await _stop(self._task)
        self._task = None
        await self.flush()


class AccessLog:
    """JSON lines, one per proxied request, written in batches to a file (0600) or standard error.

    Never the key itself, headers or (unless ``include_content``) the request body and the answer.
    """

    def __init__(self, config: AccessLogConfig) -> None:
        self._config = config
        self._lines: list[bytes] = []
        self._fd: int | None = None
        self._own_fd = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        cfg = self._config
        if cfg.path is None:
            self._fd = 2
        else:
            cfg.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(cfg.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._own_fd = True
        self._task = asyncio.create_task(self._loop())

    def write(self, job: Job, status: int, latency: float) -> None:
        entry: dict[str, Any] = {
            "ts": round(time.time(), 3),
            "request_id": job.request_id,
            "key": job.key,
            "team": job.team,
            "model": job.model,
            "path": job.path,
            "status": status,
            "stream": job.stream,
            "prompt_tokens": job.usage[0] if job.forwarded else 0,
            "completion_tokens": job.usage[1] if job.forwarded else 0,
            "latency_s": round(latency, 6),
            "ttft_s": None if job.ttft is None else round(job.ttft, 6),
            "replica": job.replica,
            "attempts": job.attempts,
            "retried": job.attempts > 1,
        }
        if self._config.include_content:
            if job.body:
                entry["request"] = job.body.decode("utf-8", "replace")
            if job.answer is not None:
                entry["response"] = job.answer.decode("utf-8", "replace")
        # pydantic-core's encoder (compact, UTF-8 as is): a fifth of the json module's time per line.
        self._lines.append(to_json(entry) + b"\n")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.flush_interval_s)
            self.flush()

    def flush(self) -> None:
        lines, self._lines = self._lines, []
        if not lines or self._fd is None:
            return
        data = b"".join(lines)
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as exc:
            logger.warning("access log: cannot write %d lines (%s)", len(lines), exc)

    async def close(self) -> None:
        await _stop(self._task)
        self._task = None
        self.flush()
        if self._own_fd and self._fd is not None:
            os.close(self._fd)
        self._fd = None


async def _stop(task: asyncio.Task[None] | None) -> None:
    """Cancel a flush loop between flushes (its own flush runs once more at close)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
