"""Replica choice: round-robin, least-load and prefix+load over an approximate per-replica prefix index."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from controlplane.gateway.config import RoutingConfig, RoutingPolicy
from controlplane.spec import ReplicaRecord

# Load is what this gateway tracks itself (outstanding requests and tokens) blended with each replica's
# scraped ``vllm:num_requests_waiting|running`` and ``vllm:kv_cache_usage_perc`` while those are fresh, and
# divided by the replica's capacity so that heterogeneous replicas compare. Affinity follows llm-d's
# endpoint picker (chained block hashes, per-replica LRU, scorer weights queue 2 / KV 2 / prefix 3, a
# saturation filter) with AIBrix's load guard on top: affinity is always blended with load.
#
# During a rollout a model's replicas run two versions: the canary's share of the traffic picks the version
# first (a deterministic running count, so that shares match the weight over any window, not only on
# average), then the scoring above picks the replica within it.

__all__ = ["ReplicaView", "Router"]


@dataclass(slots=True, eq=False)
class ReplicaView:
    """What the router knows about one ready replica; mutated only on the event loop."""

    id: str
    model: str
    endpoint: str
    capacity: float = 1.0
    adapters: frozenset[str] = frozenset()
    weights: str | None = None
    """``<model>/<digest>`` of the verified weights (see ReplicaRecord.weights)."""
    version: str = ""
    """The deployment version it runs (ReplicaRecord.version)."""
    max_model_len: int | None = None
    outstanding: int = 0
    outstanding_tokens: int = 0
    waiting: float = 0.0
    running: float = 0.0
    kv: float = 0.0
    scraped_at: float = -1e18
    failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)
    headers: dict[str, str] = field(default_factory=dict)
    """Sent with every call to the replica, where set: its deployment's engine key."""

    def fresh(self, now: float, stale_s: float) -> bool:
        return now - self.scraped_at <= stale_s

    def queue(self, now: float, stale_s: float) -> float:
        """Requests in or waiting for this replica, per unit of capacity."""
        q = float(self.outstanding)
        if self.fresh(now, stale_s):
            # Other gateways' requests only show in the scrape; ours show at once in ``outstanding``.
            q = max(q, self.running + self.waiting)
        return q / self.capacity


class Router:
    """Picks a replica per request; O(matched blocks + candidates) per decision, no I/O."""

    def __init__(self, config: RoutingConfig, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._now = monotonic
        self._replicas: dict[str, ReplicaView] = {}
        self._by_model: dict[str, list[ReplicaView]] = {}
        self._index: dict[int, set[str]] = {}
        self._rr: dict[str, int] = {}
        self._splits: dict[str, tuple[str, float]] = {}
        """Model → (canary version, share) for the models whose pool holds a canary."""
        self._split_turn: dict[str, int] = {}

    # --- replica set

    def set_replicas(
        self, records: Iterable[ReplicaRecord], canaries: Mapping[str, float] | None = None
    ) -> list[ReplicaView]:
        """Replace the ready set, keeping the load, metrics and prefix history of replicas that stay;
        ``canaries`` maps each rollout's canary version to its share of traffic (0..1).

        Returns the replicas that are new (their context length is still unknown).
        """
        keep: dict[str, ReplicaView] = {}
        new: list[ReplicaView] = []
        for rec in records:
            if rec.endpoint is None:
                continue
            old = self._replicas.get(rec.id)
            if old is not None and old.endpoint == rec.endpoint.rstrip("/"):
                old.capacity = rec.capacity
                old.adapters = frozenset(rec.adapters)
                old.model = rec.model
                old.weights = rec.weights
                old.version = rec.version
                keep[rec.id] = old
            else:
                view = ReplicaView(
                    id=rec.id,
                    model=rec.model,
                    endpoint=rec.endpoint.rstrip("/"),
                    capacity=rec.capacity,
                    adapters=frozenset(rec.adapters),
                    weights=rec.weights,
                    version=rec.version,
                )
                keep[rec.id] = view
                new.append(view)
        for rid, view in self._replicas.items():
            if keep.get(rid) is not view:
                self._forget(view)
        self._replicas = keep
        by_model: dict[str, list[ReplicaView]] = {}
        for view in keep.values():
            by_model.setdefault(view.model, []).append(view)
            for adapter in view.adapters:
                by_model.setdefault(adapter, []).append(view)
        self._by_model = by_model
        self._splits = {}
        for model, pool in by_model.items():
            versions = {v.version for v in pool}
            for version, share in (canaries or {}).items():
                if version in versions:
                    self._splits[model] = (version, max(0.0, min(1.0, share)))
        return new

    def _forget(self, view: ReplicaView) -> None:
        for h in view.lru:
            holders = self._index.get(h)
            if holders is not None:
                holders.discard(view.id)
                if not holders:
                    del self._index[h]
        view.lru.clear()

    @property
    def replicas(self) -> list[ReplicaView]:
        return list(self._replicas.values())

    def models(self) -> dict[str, list[ReplicaView]]:
        return self._by_model

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def capacity(self, model: str) -> float:
        return sum(r.capacity for r in self._by_model.get(model, ()))

    def max_context(self, model: str) -> int | None:
        lens = [r.max_model_len for r in self._by_model.get(model, ()) if r.max_model_len]
        return min(lens) if lens else None

    def ejected(self) -> int:
        now = self._now()
        return sum(1 for r in self._replicas.values() if r.ejected_until > now)

    # --- decisions

    def pick(
        self, model: str, blocks: list[int], exclude: frozenset[str] = frozenset()
    ) -> ReplicaView | None:
        """The replica for one request, or None when no replica serves ``model`` (or all are excluded)."""
        pool = self._by_model.get(model)
        if not pool:
            return None
        now = self._now()
        cands = [r for r in pool if r.id not in exclude and r.ejected_until <= now]
        if not cands:
            # Everything is ejected: trying an ejected replica beats refusing outright.
            cands = [r for r in pool if r.id not in exclude]
            if not cands:
                return None
        key = model
        split = self._splits.get(model)
        if split is not None:
            cands = self._version(model, cands, split)
            # Each version rotates on its own: one shared turn would tie the offset to the version.
            key = f"{model}\0{cands[0].version}"
        turn = self._rr.get(key, 0)
        self._rr[key] = turn + 1
        n = len(cands)
        if n == 1:
            return cands[0]
        policy = self.config.policy
        if policy is RoutingPolicy.ROUND_ROBIN:
            return cands[turn % n]
        return self._score(cands, blocks if policy is RoutingPolicy.PREFIX_LOAD else [], now, turn)

    def _version(self, model: str, cands: list[ReplicaView], split: tuple[str, float]) -> list[ReplicaView]:
        """The candidates of the version this request goes to: the canary for its share of the model's
        requests (request n goes to it when ``floor(n × share)`` steps up), else the stable version;
        the other version when the chosen one has no candidate left (it is not ready, or excluded)."""
        version, share = split
        turn = self._split_turn.get(model, 0)
        self._split_turn[model] = turn + 1
        to_canary = int((turn + 1) * share + 1e-9) > int(turn * share + 1e-9)
        chosen = [r for r in cands if (r.version == version) is to_canary]
        return chosen or cands

    def _matches(self, blocks: list[int]) -> dict[str, int]:
        # Chained hashes: holding block i implies holding blocks 0..i-1 (up to LRU eviction), so one walk
        # from the front, stopping at the first block nobody holds, gives every replica's match length.
        matched: dict[str, int] = {}
        index = self._index
        for i, h in enumerate(blocks):
            holders = index.get(h)
            if not holders:
                break
            for rid in holders:
                matched[rid] = i + 1
        return matched

    def _score(self, cands: list[ReplicaView], blocks: list[int], now: float, turn: int) -> ReplicaView:
        cfg = self.config
        stale = cfg.metrics_stale_s
        # One pass for the per-replica numbers (inlined: this loop runs for every candidate of every request).
        queues: list[float] = []
        fresh: list[bool] = []
        for r in cands:
            f = now - r.scraped_at <= stale
            q = float(r.outstanding)
            if f and r.running + r.waiting > q:
                # Other gateways' requests only show in the scrape; ours show at once in ``outstanding``.
                q = r.running + r.waiting
            queues.append(q / r.capacity)
            fresh.append(f)
        qmin, qmax = min(queues), max(queues)
        spread = qmax - qmin
        matched = self._matches(blocks) if blocks and spread <= cfg.load_guard_spread else {}
        # (AIBrix's guard above: when load is that uneven, affinity is not worth it.)
        inv_blocks = 1.0 / (len(blocks) or 1)
        qw, kw, pw = cfg.queue_weight, cfg.kv_weight, cfg.prefix_weight
        sat_q, sat_kv = cfg.saturation_queue, cfg.saturation_kv
        best = cands[0]
        best_score = -1.0
        best_q = 0.0
        n = len(cands)
        # Start at a rotating offset so that equal scores (an idle fleet) spread instead of piling on one.
        for k in range(n):
            i = (turn + k) % n
            r = cands[i]
            q = queues[i]
            score = qw * (1.0 - (q - qmin) / spread) if spread > 0 else qw
            if fresh[i]:
                kv = r.kv
                score += kw * (1.0 - (kv if kv < 1.0 else 1.0))
                saturated = r.waiting / r.capacity >= sat_q or kv >= sat_kv
            else:
                score += kw
                saturated = False
            if matched and not saturated:
                m = matched.get(r.id)
                if m:
                    score += pw * m * inv_blocks
            if score > best_score or (score == best_score and q < best_q):
                best, best_score, best_q = r, score, q
        return best

    # --- bookkeeping around one request

    def on_start(self, replica: ReplicaView, tokens: int, blocks: list[int]) -> None:
        replica.outstanding += 1
        replica.outstanding_tokens += tokens
        if blocks:
            self._remember(replica, blocks)

    def _remember(self, replica: ReplicaView, blocks: list[int]) -> None:
        lru = replica.lru
        index = self._index
        rid = replica.id
        for h in blocks:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders = index.get(h)
                if holders is None:
                    index[h] = {rid}
                else:
                    holders.add(rid)
        cap = self.config.lru_blocks_per_replica
        while len(lru) > cap:
            old, _ = lru.popitem(last=False)
            holders = index.get(old)
            if holders is not None:
                holders.discard(rid)
                if not holders:
                    del index[old]

    def on_finish(self, replica: ReplicaView, tokens: int) -> None:
        replica.outstanding = max(0, replica.outstanding - 1)
        replica.outstanding_tokens = max(0, replica.outstanding_tokens - tokens)

    def on_success(self, replica: ReplicaView) -> None:
        replica.failures = 0
        if replica.ejections and self._now() > replica.ejected_until + self.config.eject_s:
            replica.ejections = 0

    def on_failure(self, replica: ReplicaView) -> bool:
        """Count a failed call; True when the replica has just been ejected."""
        replica.failures += 1
        if replica.failures < self.config.eject_after_failures:
            return False
        replica.failures = 0
        replica.ejected_until = self._now() + self.config.eject_s * (2 ** min(replica.ejections, 3))
        replica.ejections += 1
        return True

    def observe(self, replica_id: str, *, waiting: float, running: float, kv: float) -> None:
        r = self._replicas.get(replica_id)
        if r is not None:
            r.waiting, r.running, r.kv, r.scraped_at = waiting, running, kv, self._now()
