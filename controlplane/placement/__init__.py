"""Pure placement planner: ``plan(fleet, spec, model, placed=(), *, avoid_nodes=(), explain=False) -> Plan``.

Pipeline per replica (HOUSE_STYLE #16): layouts to try (the user's pp, else pp = 1, 2, … in one node, then
pp across nodes with tp GPUs on each) → filters (:class:`SlotFilter`: node selector, memory per GPU type,
free GPUs; each refusal is a reason naming the node and the numbers) → GPU types tightest fit first →
candidates (a TP group per stage, NVLink before one PCIe switch before one NUMA node) → scorers
(:class:`Scorer`, weighted, summed and normalised: packing for binpack/spread, topology, anti-affinity
between replicas of one deployment). Ties go to node name order, so the same input gives the same plan.

Other entry points: ``plan_many(fleet, requests, placed=(), *, attempts=16)`` places many deployments on
one view of the fleet (highest regret and largest first, every replica at its cheapest GPU count before
any fallback, best of up to ``attempts`` seeded orders); ``plan_cpu(fleet, spec, placed, avoid_nodes=())``
gives CPU engines (``sim``, ``vllm-cpu``) one ``gpus=[]`` shard per replica without a memory check
(``plan`` calls it for them); ``plan_to_json(plan)`` is the ``llmctl plan --output json`` contract.
"""

from controlplane.placement._index import LINK_NAMES, FleetIndex, GpuType, Slot, group_level, link_name
from controlplane.placement._pipeline import (
    AntiAffinityScorer,
    Candidate,
    FreeGpuFilter,
    MemoryFilter,
    MemoryFitScorer,
    PackingScorer,
    PlacementContext,
    Scorer,
    SelectorFilter,
    SlotFilter,
    TopologyScorer,
    default_filters,
    default_scorers,
)
from controlplane.placement._planner import (
    ATTEMPTS,
    CPU_ENGINES,
    PlacementRequest,
    Planner,
    plan,
    plan_cpu,
    plan_many,
    plan_to_json,
)

__all__ = [
    "ATTEMPTS",
    "CPU_ENGINES",
    "LINK_NAMES",
    "AntiAffinityScorer",
    "Candidate",
    "FleetIndex",
    "FreeGpuFilter",
    "GpuType",
    "MemoryFilter",
    "MemoryFitScorer",
    "PackingScorer",
    "PlacementContext",
    "PlacementRequest",
    "Planner",
    "Scorer",
    "SelectorFilter",
    "Slot",
    "SlotFilter",
    "TopologyScorer",
    "default_filters",
    "default_scorers",
    "group_level",
    "link_name",
    "plan",
    "plan_cpu",
    "plan_many",
    "plan_to_json",
]
