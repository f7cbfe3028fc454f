"""Filter and scorer protocols of the planner pipeline, and the built-in filters and scorers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from controlplane.catalog import MemoryEstimate
from controlplane.placement._index import NVLINK, GpuType, Slot
from controlplane.spec import DeploymentSpec, ModelSpec, Strategy

__all__ = [
    "AntiAffinityScorer",
    "Candidate",
    "FreeGpuFilter",
    "MemoryFilter",
    "MemoryFitScorer",
    "PackingScorer",
    "PlacementContext",
    "Scorer",
    "SelectorFilter",
    "SlotFilter",
    "TopologyScorer",
    "default_filters",
    "default_scorers",
    "gib",
]


def gib(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB"


@dataclass(slots=True)
class PlacementContext:
    """One replica being placed: the request, the layout being tried and its memory need per GPU type."""

    spec: DeploymentSpec
    model: ModelSpec
    tp: int
    pp: int
    across_nodes: bool
    """False: all pp stages on one node (tp × pp GPUs there); True: one stage of tp GPUs per node."""
    estimates: dict[GpuType, MemoryEstimate]
    """Memory per GPU of this layout on each GPU type of the fleet."""
    avoid: set[str] = field(default_factory=set)
    """Nodes already hosting a replica of this deployment (soft anti-affinity)."""

    @property
    def gpus_per_node(self) -> int:
        return self.tp if self.across_nodes else self.tp * self.pp


@dataclass(slots=True)
class Candidate:
    """One way to place the replica: a TP group per pipeline stage."""

    stages: tuple[tuple[Slot, tuple[int, ...]], ...]
    estimate: MemoryEstimate
    level: int
    """Weakest link level over the stages' TP groups (see ``_index.LINK_NAMES``)."""

    def used_after(self) -> list[float]:
        """Fraction of each stage's node (GPU type) in use once this candidate is taken."""
        if len(self.stages) == 1 or self.stages[0][0] is self.stages[-1][0]:
            slot = self.stages[0][0]
            taken = sum(len(g) for _, g in self.stages)
            return [(slot.size - len(slot.free) + taken) / slot.size]
        return [(slot.size - len(slot.free) + len(g)) / slot.size for slot, g in self.stages]


class SlotFilter(Protocol):
    """Keeps the slots that can take the replica; says why for each one it drops."""

    name: str

    def __call__(self, slots: Sequence[Slot], ctx: PlacementContext) -> tuple[list[Slot], list[str]]: ...


class Scorer(Protocol):
    """Rates a candidate in [0, 1]; the planner sums weight × score and normalises by the weights."""

    name: str
    weight: float

    def score(self, candidate: Candidate, ctx: PlacementContext) -> float: ...


# --- filters


class SelectorFilter:
    """``node_selector``: only nodes whose labels contain every requested pair."""

    name = "selector"

    def __call__(self, slots: Sequence[Slot], ctx: PlacementContext) -> tuple[list[Slot], list[str]]:
        want = ctx.spec.node_selector
        if not want:
            return list(slots), []
        keep: list[Slot] = []
        reasons: list[str] = []
        for slot in slots:
            labels = slot.node.labels
            missing = {k: v for k, v in want.items() if labels.get(k) != v}
            if missing:
                have = ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "none"
                need = ",".join(f"{k}={v}" for k, v in sorted(missing.items()))
                reasons.append(f"{slot.name}: labels {have} do not match node selector {need}")
            else:
                keep.append(slot)
        return keep, reasons


class MemoryFilter:
    """The layout's per-GPU need (weights + overhead + KV) must fit this GPU type's budget."""

    name = "memory"

    def __call__(self, slots: Sequence[Slot], ctx: PlacementContext) -> tuple[list[Slot], list[str]]:
        keep: list[Slot] = []
        reasons: list[str] = []
        fits = {t: e.fits for t, e in ctx.estimates.items()}
        for slot in slots:
            if fits.get(slot.gpu_type, False):
                keep.append(slot)
                continue
            est = ctx.estimates.get(slot.gpu_type)
            if est is None:
                reasons.append(f"{slot.name}: {slot.gpu_type} cannot hold {ctx.model.name} at pp={ctx.pp}")
                continue
            reasons.append(
                f"{slot.name}: {slot.gpu_type} has {gib(est.budget_mib)} usable per GPU "
                f"({est.gpu_memory_utilization:.2f} × {gib(est.gpu_memory_mib)}), tp={ctx.tp} pp={ctx.pp} "
                f"needs {gib(est.required_mib)} each (weights {gib(est.weights_mib)} + overhead "
                f"{gib(est.overhead_mib)} + KV {gib(est.required_mib - est.weights_mib - est.overhead_mib)})"
            )
        return keep, reasons


class FreeGpuFilter:
    """Enough free GPUs of the type on the node: tp × pp in one node, or tp per node across nodes."""

    name = "free-gpus"

    def __call__(self, slots: Sequence[Slot], ctx: PlacementContext) -> tuple[list[Slot], list[str]]:
        need = ctx.gpus_per_node
        keep: list[Slot] = []
        reasons: list[str] = []
        for slot in slots:
            if len(slot.free) >= need:
                keep.append(slot)
                continue
            est = ctx.estimates.get(slot.gpu_type)
            each = f" with {gib(est.required_mib)} each" if est is not None else ""
            layout = f"tp={ctx.tp}" + (f" pp={ctx.pp}" if ctx.pp > 1 else "")
            where = " per node" if ctx.across_nodes else ""
            blocked = ""
            if slot.blocked:
                parts = [f"GPU {i}: {why}" for i, why in sorted(slot.blocked.items())]
                blocked = " (" + "; ".join(parts[:4]) + ("; …" if len(parts) > 4 else "") + ")"
            if len(slot.free) < slot.size and not slot.blocked:
                blocked = f" ({slot.size - len(slot.free)} taken by replicas planned before this one)"
            reasons.append(
                f"{slot.name}: {len(slot.free)} free {slot.gpu_type}, {layout} needs {need} GPUs{where}"
                f"{each}{blocked}"
            )
        return keep, reasons


def default_filters() -> list[SlotFilter]:
    return [SelectorFilter(), MemoryFilter(), FreeGpuFilter()]


# --- scorers


class PackingScorer:
    """binpack: prefer nodes left fullest (whole nodes stay free for big replicas); spread: emptiest."""

    name = "packing"

    def __init__(self, strategy: Strategy, weight: float = 1.0) -> None:
        self.strategy = strategy
        self.weight = weight

    def score(self, candidate: Candidate, ctx: PlacementContext) -> float:
        used = candidate.used_after()
        mean = sum(used) / len(used)
        return mean if self.strategy is Strategy.BINPACK else 1.0 - mean


class TopologyScorer:
    """TP groups on NVLink, then one PCIe switch, then one NUMA node."""

    name = "topology"

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight

    def score(self, candidate: Candidate, ctx: PlacementContext) -> float:
        return candidate.level / NVLINK


class AntiAffinityScorer:
    """Replicas of one deployment prefer different nodes (a node failure takes fewer of them)."""

    name = "anti-affinity"

    def __init__(self, weight: float = 2.0) -> None:
        self.weight = weight

    def score(self, candidate: Candidate, ctx: PlacementContext) -> float:
        nodes = {slot.name for slot, _ in candidate.stages}
        return sum(1 for n in nodes if n not in ctx.avoid) / len(nodes)


class MemoryFitScorer:
    """Prefer the GPU type the replica fills best, keeping large GPUs for the models that need them."""

    name = "memory-fit"

    def __init__(self, weight: float = 0.5) -> None:
        self.weight = weight

    def score(self, candidate: Candidate, ctx: PlacementContext) -> float:
        est = candidate.estimate
        return min(1.0, est.required_mib / est.budget_mib)


def default_scorers(strategy: Strategy) -> list[Scorer]:
    # No MemoryFitScorer here: the planner already tries GPU types tightest fit first and scores the
    # nodes of one type at a time, where it is constant. It is kept for custom pipelines.
    return [PackingScorer(strategy), TopologyScorer(), AntiAffinityScorer()]
