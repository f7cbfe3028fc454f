"""The planner's mutable view of the fleet: free GPUs per node and GPU type, bucketed for fast best-fit."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from controlplane.spec import Fleet, Interconnect, Node, Shard

__all__ = ["LINK_NAMES", "FleetIndex", "GpuType", "Slot", "gpu_mask", "group_level", "link_name"]

# Link levels of a TP group, best first: every pair on NVLink, behind one PCIe switch, on one NUMA node.
NVLINK, PCIE_SWITCH, NUMA, CROSS_NUMA = 3, 2, 1, 0
LINK_NAMES = {NVLINK: "nvlink", PCIE_SWITCH: "pcie-switch", NUMA: "numa", CROSS_NUMA: "cross-numa"}

# Above this many TP groups per node the group search turns greedy (8 GPUs choose 4 is 70).
_MAX_COMBINATIONS = 256


class GpuType(NamedTuple):
    """GPUs that are interchangeable for memory: same product name and size."""

    # A NamedTuple rather than a frozen dataclass: it is a dict key on the planner's hot path and
    # tuple hashing is done in C.
    model: str
    memory_mib: int

    def __str__(self) -> str:
        return self.model


@dataclass(eq=False, slots=True)
class Slot:
    """The GPUs of one type on one node, and which of them the planner may still hand out."""

    rank: int
    """Position in (node name, GPU type) order: the deterministic tie-break."""
    node: Node
    gpu_type: GpuType
    indices: tuple[int, ...]
    free: set[int]
    blocked: dict[int, str]
    """GPUs that exist but cannot be used, with why (a placed replica, memory in use)."""
    levels: dict[tuple[int, int], int]
    """Link level of each GPU pair (i < j)."""
    topology: int
    """Equal for slots wired the same way (same GPU type, indices and links), so group choices and
    scores can be shared between them."""
    free_mask: int = 0
    """``free`` as a bit mask (bit i = GPU i), kept in step with it: a cheap cache key."""

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def size(self) -> int:
        return len(self.indices)


def group_level(levels: dict[tuple[int, int], int], gpus: Sequence[int]) -> int:
    """The weakest link between any two GPUs of a group (a single GPU counts as NVLink)."""
    level = NVLINK
    for a, b in itertools.combinations(sorted(gpus), 2):
        level = min(level, levels[(a, b)])
    return level


def _pair_levels(node: Node, indices: Sequence[int]) -> dict[tuple[int, int], int]:
    gpus = {g.index: g for g in node.gpus}
    # Declared inventories may only say "interconnect: nvlink" without per-GPU peers: treat that
    # as an NVSwitch node where every pair is linked.
    all_nvlink = node.interconnect is Interconnect.NVLINK and not any(g.nvlink_peers for g in node.gpus)
    levels: dict[tuple[int, int], int] = {}
    for a, b in itertools.combinations(indices, 2):
        ga, gb = gpus[a], gpus[b]
        if all_nvlink or b in ga.nvlink_peers or a in gb.nvlink_peers:
            level = NVLINK
        elif ga.pcie_switch is not None and ga.pcie_switch == gb.pcie_switch:
            level = PCIE_SWITCH
        elif ga.numa_node is not None and ga.numa_node == gb.numa_node:
            level = NUMA
        else:
            level = CROSS_NUMA
        levels[(a, b)] = level
    return levels


@dataclass(slots=True)
class _TypeBuckets:
    gpu_type: GpuType
    largest: int = 0
    buckets: list[list[int]] = field(default_factory=list)
    """``buckets[n]``: ranks of slots with exactly ``n`` free GPUs, ascending."""


class FleetIndex:
    """Free GPUs of the fleet, by GPU type and free count; take/rollback for trial placements."""

    def __init__(self, fleet: Fleet, placed: Sequence[Shard], *, utilization: float) -> None:
        taken: dict[str, set[int]] = {}
        for shard in placed:
            taken.setdefault(shard.node, set()).update(shard.gpus)
        slots: list[Slot] = []
        # Pair levels per distinct wiring: a 1,000-node fleet usually has a handful.
        topologies: dict[tuple[object, ...], tuple[int, dict[tuple[int, int], int]]] = {}
        for node in sorted(fleet.nodes, key=lambda n: n.name):
            by_type: dict[GpuType, list[int]] = {}
            for gpu in node.gpus:
                by_type.setdefault(GpuType(gpu.model, gpu.memory_total_mib), []).append(gpu.index)
            gpus = {g.index: g for g in node.gpus}
            for gpu_type in sorted(by_type, key=lambda t: (t.model, t.memory_mib)):
                indices = tuple(sorted(by_type[gpu_type]))
                blocked: dict[int, str] = {}
                for i in indices:
                    need = utilization * gpus[i].memory_total_mib
                    if i in taken.get(node.name, ()):
                        blocked[i] = "placed replica"
                    elif gpus[i].memory_free_mib < need:
                        # vLLM refuses to start when free memory is below utilization × total.
                        blocked[i] = f"{gpus[i].memory_free_mib / 1024:.1f} GiB free < {need / 1024:.1f} GiB"
                signature = tuple(
                    (i, tuple(sorted(gpus[i].nvlink_peers)), gpus[i].pcie_switch, gpus[i].numa_node)
                    for i in indices
                )
                key = (gpu_type, node.interconnect, signature)
                if key not in topologies:
                    topologies[key] = (len(topologies), _pair_levels(node, indices))
                topology, levels = topologies[key]
                free = {i for i in indices if i not in blocked}
                slots.append(
                    Slot(
                        rank=len(slots),
                        node=node,
                        gpu_type=gpu_type,
                        indices=indices,
                        free=free,
                        blocked=blocked,
                        levels=levels,
                        topology=topology,
                        free_mask=gpu_mask(free),
                    )
                )
        self.slots = slots
        self._types: dict[GpuType, _TypeBuckets] = {}
        for slot in slots:
            tb = self._types.setdefault(slot.gpu_type, _TypeBuckets(slot.gpu_type))
            while len(tb.buckets) <= slot.size:
                tb.buckets.append([])
            tb.largest = max(tb.largest, slot.size)
            tb.buckets[len(slot.free)].append(slot.rank)  # ranks arrive ascending
        self._log: list[tuple[Slot, tuple[int, ...]]] = []
        self._groups: dict[tuple[int, int, int], tuple[tuple[int, ...], int]] = {}

    # --- queries

    def gpu_types(self) -> list[GpuType]:
        return sorted(self._types, key=lambda t: (t.model, t.memory_mib))

    def largest_free(self, gpu_type: GpuType) -> int:
        """Most free GPUs of this type on any one node."""
        tb = self._types[gpu_type]
        for n in range(len(tb.buckets) - 1, 0, -1):
            if tb.buckets[n]:
                return n
        return 0

    def count_with_free(self, gpu_type: GpuType, need: int) -> int:
        """Nodes with at least ``need`` free GPUs of this type."""
        tb = self._types[gpu_type]
        return sum(len(b) for b in tb.buckets[need:])

    def stream(self, gpu_type: GpuType, need: int, *, fullest_first: bool) -> Iterator[Slot]:
        """Slots of ``gpu_type`` with at least ``need`` free GPUs: fullest first (binpack) or emptiest
        first (spread); node name order within equally free nodes."""
        tb = self._types[gpu_type]
        counts = range(need, len(tb.buckets))
        for n in counts if fullest_first else reversed(counts):
            for rank in tb.buckets[n]:
                yield self.slots[rank]

    def best_group(self, slot: Slot, free_mask: int, k: int) -> tuple[tuple[int, ...], int] | None:
        """The best ``k`` of the GPUs in ``free_mask`` for one TP group, and their link level; None
        if there are fewer than ``k``."""
        key = (slot.topology, free_mask, k)
        hit = self._groups.get(key)
        if hit is None:
            free = [i for i in slot.indices if free_mask >> i & 1]
            if len(free) < k:
                return None
            hit = self._search_group(slot, free, k)
            self._groups[key] = hit
        return hit

    @staticmethod
    def _search_group(slot: Slot, free: list[int], k: int) -> tuple[tuple[int, ...], int]:
        levels = slot.levels
        if k == 1:
            # A single GPU: take one from the least-free switch/NUMA domain so larger groups stay whole.
            def crowd(i: int) -> tuple[int, int]:
                return (sum(1 for j in free if j != i and levels[(min(i, j), max(i, j))] >= NUMA), i)

            return (min(free, key=crowd),), NVLINK
        combos: Iterator[tuple[int, ...]] | list[tuple[int, ...]]
        n_combos = 1
        for x in range(k):
            n_combos = n_combos * (len(free) - x) // (x + 1)
        if n_combos <= _MAX_COMBINATIONS:
            combos = itertools.combinations(free, k)
        else:
            combos = [_greedy_group(levels, free, k)]
        best: tuple[int, ...] = tuple(free[:k])
        best_key = (-1, -1)
        for group in combos:
            level = group_level(levels, group)
            rest = [i for i in free if i not in group]
            # Sort key: strongest link first, then leave the remaining GPUs as well linked as possible
            # (a later TP group of the same size should find a good set too).
            rest_level = group_level(levels, rest[:k]) if len(rest) >= k else NVLINK
            candidate_key = (level, rest_level)
            if candidate_key > best_key:
                best, best_key = group, candidate_key
        return best, best_key[0]

    # --- changes

    def take(self, slot: Slot, gpus: Sequence[int]) -> None:
        self._move(slot, gpus, release=False)
        self._log.append((slot, tuple(gpus)))

    def mark(self) -> int:
        return len(self._log)

    def rollback(self, mark: int) -> None:
        while len(self._log) > mark:
            slot, gpus = self._log.pop()
            self._move(slot, gpus, release=True)

    def _move(self, slot: Slot, gpus: Sequence[int], *, release: bool) -> None:
        tb = self._types[slot.gpu_type]
        bucket = tb.buckets[len(slot.free)]
        bucket.pop(bisect.bisect_left(bucket, slot.rank))
        if release:
            slot.free.update(gpus)
        else:
            slot.free.difference_update(gpus)
        slot.free_mask = gpu_mask(slot.free)
        bisect.insort(tb.buckets[len(slot.free)], slot.rank)


def gpu_mask(indices: set[int] | Sequence[int]) -> int:
    mask = 0
    for i in indices:
        mask |= 1 << i
    return mask


def _greedy_group(levels: dict[tuple[int, int], int], free: list[int], k: int) -> tuple[int, ...]:
    """Start from each GPU, keep adding the GPU with the strongest weakest link; best start wins."""
    best: tuple[int, ...] = ()
    best_level = -1
    for start in free:
        group = [start]
        while len(group) < k:
            nxt = max(
                (i for i in free if i not in group),
                key=lambda i: (min(levels[(min(i, j), max(i, j))] for j in group), -i),
            )
            group.append(nxt)
        level = group_level(levels, group)
        if level > best_level:
            best, best_level = tuple(sorted(group)), level
    return best


def link_name(node: Node, gpus: Sequence[int]) -> str:
    """How the GPUs of one TP group on ``node`` talk: nvlink, pcie-switch, numa or cross-numa."""
    indices = sorted(gpus)
    return LINK_NAMES[group_level(_pair_levels(node, indices), indices)]
