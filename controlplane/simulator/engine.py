"""The simulated engine: FIFO admission under ``max_num_seqs`` and KV capacity, LRU prefix cache, latency."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from controlplane.simulator.config import LatencyMode, SimConfig
from controlplane.simulator.metrics import SimMetrics

__all__ = ["BatchEngine", "ClientGone", "PrefixCache", "Slot", "block_hashes"]


class ClientGone(Exception):
    """The client disconnected while its request waited or ran."""


def block_hashes(
    tokens: Sequence[Hashable], block_size: int, limit_tokens: int, salt: Hashable = None
) -> list[int]:
    """Chained hashes of the full blocks within the first ``limit_tokens`` tokens.

    Each hash covers its block and, through the parent hash, everything before it, so a block only
    matches when the whole prefix up to it matches (vLLM's scheme). Python's ``hash`` is enough: the
    cache lives and dies with this process.
    """
    out: list[int] = []
    parent = hash(salt)
    for start in range(0, limit_tokens - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        out.append(parent)
    return out


class PrefixCache:
    """KV blocks: in use by running requests (ref-counted), cached-but-free (LRU), or unhashed.

    A free cached block still occupies a physical block until evicted; new allocations evict the least
    recently freed ones first. Blocks of a finished request are freed tail first, so that eviction
    removes the end of a prefix chain before its head (as vLLM does).
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._refs: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict()
        self._anon = 0
        self.evictions = 0

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests (what vLLM's ``kv_cache_usage_perc`` counts)."""
        return len(self._refs) + self._anon

    @property
    def cached_blocks(self) -> int:
        return len(self._refs) + len(self._free)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks already cached."""
        n = 0
        for h in hashes:
            if h not in self._refs and h not in self._free:
                break
            n += 1
        return n

    def fits(self, hashes: Sequence[int], total_blocks: int) -> bool:
        present = 0
        revived = 0
        for h in hashes:
            if h in self._refs:
                present += 1
            elif h in self._free:
                present += 1
                revived += 1
        available = self.capacity - len(self._refs) - self._anon - revived
        return total_blocks - present <= available

    def allocate(self, hashes: Sequence[int], total_blocks: int) -> None:
        """Take ``total_blocks`` blocks, reusing cached ones; the caller checked :meth:`fits`."""
        for h in hashes:
            if h in self._refs:
                self._refs[h] += 1
            else:
                self._free.pop(h, None)
                self._refs[h] = 1
        self._anon += total_blocks - len(hashes)
        while self._free and len(self._refs) + self._anon + len(self._free) > self.capacity:
            self._free.popitem(last=False)
            self.evictions += 1

    def release(self, hashes: Sequence[int], total_blocks: int) -> None:
        self._anon -= total_blocks - len(hashes)
        for h in reversed(hashes):
            left = self._refs[h] - 1
            if left:
                self._refs[h] = left
            else:
                del self._refs[h]
                self._free[h] = None


@dataclass
class Slot:
    """One admitted request: what it holds and when its phases happened (loop time)."""

    seqs: int
    hashes: list[int]
    total_blocks: int
    prompt_tokens: int
    cached_tokens: int
    adapter: str | None
    arrival: float
    started: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    running: bool = field(default=False, repr=False)


@dataclass
class _Waiter:
    slot: Slot
    future: asyncio.Future[None]


class BatchEngine:
    """State shared by all requests of one replica; runs on a single event loop, so no locks."""

    def __init__(self, config: SimConfig, metrics: SimMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.cache = PrefixCache(config.kv_cache_tokens // config.block_size)
        self.running_seqs = 0
        self._waiting: deque[_Waiter] = deque()

    # --- admission

    def prepare(
        self, tokens: Sequence[Hashable], max_output: int, seqs: int, adapter: str | None, now: float
    ) -> Slot:
        """Describe a request's KV needs; nothing is taken until :meth:`acquire`."""
        cfg = self.config
        bs = cfg.block_size
        n_prompt = len(tokens)
        hashes: list[int] = []
        if cfg.enable_prefix_caching and n_prompt > 1:
            # The last prompt token is always recomputed (it yields the first logits), so at most
            # (n_prompt - 1) tokens can hit, as in vLLM. Adapters change the KV, so they salt the chain.
            hashes = block_hashes(tokens, bs, n_prompt - 1, salt=adapter)
        total = -(-(n_prompt + max_output) // bs) + (seqs - 1) * -(-max_output // bs)
        return Slot(
            seqs=seqs,
            hashes=hashes,
            total_blocks=total,
            prompt_tokens=n_prompt,
            cached_tokens=0,
            adapter=adapter,
            arrival=now,
        )

    def _can_start(self, slot: Slot) -> bool:
        return self.running_seqs + slot.seqs <= self.config.max_num_seqs and self.cache.fits(
            slot.hashes, slot.total_blocks
        )

    def _start(self, slot: Slot, now: float) -> None:
        hit_blocks = self.cache.match(slot.hashes)
        slot.cached_tokens = hit_blocks * self.config.block_size
        self.cache.allocate(slot.hashes, slot.total_blocks)
        self.running_seqs += slot.seqs
        slot.started = now
        slot.running = True
        m = self.metrics
        m.running = self.running_seqs
        m.kv_usage = self.cache.used_blocks / self.cache.capacity
        m.prefix_queries += slot.prompt_tokens
        m.prefix_hits += slot.cached_tokens
        if slot.adapter:
            m.lora_running[slot.adapter] += 1
        m.queue.observe(now - slot.arrival)

    async def acquire(self, slot: Slot, gone: asyncio.Future[Any], loop: asyncio.AbstractEventLoop) -> None:
        """Start ``slot`` now or after the requests queued before it.

        Raises :class:`ClientGone` when ``gone`` (the client's disconnect) completes first.
        """
        if not self._waiting and self._can_start(slot):
            self._start(slot, loop.time())
            return
        waiter = _Waiter(slot, loop.create_future())
        self._waiting.append(waiter)
        self._set_waiting()
        try:
            await asyncio.wait((waiter.future, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiter.future.done():
                waiter.future.cancel()
                self._remove(waiter)
        if gone.done():
            # Started and immediately abandoned: give the slot back.
            self.release(slot, loop.time())
            raise ClientGone

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiting.remove(waiter)
        except ValueError:
            return
        self._set_waiting()
        self._pump(asyncio.get_running_loop().time())

    def _set_waiting(self) -> None:
        m = self.metrics
        m.waiting = sum(w.slot.seqs for w in self._waiting)
        if m.lora_waiting:
            for name in m.lora_waiting:
                m.lora_waiting[name] = 0
            for w in self._waiting:
                if w.slot.adapter:
                    m.lora_waiting[w.slot.adapter] += 1

    def _pump(self, now: float) -> None:
        # Strict FIFO: the head blocks the queue until it fits, as vLLM's FCFS scheduler does.
        started = False
        while self._waiting and self._can_start(self._waiting[0].slot):
            waiter = self._waiting.popleft()
            self._start(waiter.slot, now)
            waiter.future.set_result(None)
            started = True
        if started:
            self._set_waiting()

    def release(self, slot: Slot, now: float) -> None:
        if not slot.running:
            return
        slot.running = False
        self.cache.release(slot.hashes, slot.total_blocks)
        self.running_seqs -= slot.seqs
        m = self.metrics
        m.running = self.running_seqs
        m.kv_usage = self.cache.used_blocks / self.cache.capacity
        if slot.adapter:
            m.lora_running[slot.adapter] -= 1
        self._pump(now)

    # --- latency model

    def _load(self) -> float:
        cfg = self.config
        if cfg.load_factor == 1.0 or cfg.max_num_seqs == 1:
            return 1.0
        busy = max(0, self.running_seqs - 1) / (cfg.max_num_seqs - 1)
        return 1.0 + (cfg.load_factor - 1.0) * busy

    def ttft(self, slot: Slot) -> float:
        """Seconds from admission to the first token."""
        cfg = self.config
        if cfg.latency_mode is LatencyMode.FIXED:
            return cfg.fixed_ttft_ms / 1000
        uncached = slot.prompt_tokens - slot.cached_tokens
        return (cfg.ttft_ms + uncached * cfg.prefill_ms_per_token) * self._load() / 1000

    def itl(self) -> float:
        """Seconds until the next token, under the current load."""
        cfg = self.config
        if cfg.latency_mode is LatencyMode.FIXED:
            return cfg.fixed_itl_ms / 1000
        return cfg.itl_ms * self._load() / 1000
