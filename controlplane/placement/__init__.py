"""Pure placement: ``place(fleet, spec, model, placed=(), *, is_local=…, local_cpus=None, avoid_nodes=(),
explain=False) -> Plan``, the one entry that ``llmctl plan`` and ``llmctl deploy`` call.

``place`` gives a spec GPU placement or CPU placement (:func:`uses_gpus`: ``vllm`` always, ``vllm-cpu``
never, ``sim`` when a matching node declares GPUs). ``is_local`` answers "is this node this host?" and
``local_cpus`` is this host's core count: the caller knows them, placement does no I/O.
``choose_engine(fleet)`` is the engine ``--engine auto`` runs.

GPU placement, ``plan(fleet, spec, model, placed=(), *, avoid_nodes=(), explain=False)``, per replica:
layouts to try (the user's pp, else pp = 1, 2, … in one node, then pp across nodes with tp GPUs on each)
→ filters (:class:`SlotFilter`: node selector, memory per GPU type, free GPUs; each refusal is a reason
naming the node and the numbers) → GPU types tightest fit first → candidates (a TP group per stage,
NVLink before one PCIe switch before one NUMA node) → scorers (:class:`Scorer`, weighted, summed and
normalised: packing for binpack/spread, topology, anti-affinity between replicas of one deployment). Ties
go to node name order, so the same input gives the same plan.

CPU placement, ``plan_cpu(fleet, spec, placed=(), *, is_local=…, local_cpus=None, avoid_nodes=())``: each
replica at the requested tp × pp with all its stages on one node and ``gpus=[]``, on this host when it is
one of the matching nodes, else on the matching nodes; no memory check.

Other entry points: ``plan_many(fleet, requests, placed=(), *, attempts=16)`` places many deployments on
one view of the fleet (highest regret and largest first, every replica at its cheapest GPU count before
any fallback, best of up to ``attempts`` seeded orders; GPU placement); ``plan_to_json(plan)`` is the
``llmctl plan --output json`` contract.
"""

from controlplane.placement._cpu import IsLocal, nowhere, plan_cpu
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
from controlplane.placement._place import choose_engine, place, uses_gpus
from controlplane.placement._planner import (
    ATTEMPTS,
    PlacementRequest,
    Planner,
    plan,
    plan_many,
    plan_to_json,
)

__all__ = [
    "ATTEMPTS",
    "LINK_NAMES",
    "AntiAffinityScorer",
    "Candidate",
    "FleetIndex",
    "FreeGpuFilter",
    "GpuType",
    "IsLocal",
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
    "choose_engine",
    "default_filters",
    "default_scorers",
    "group_level",
    "link_name",
    "nowhere",
    "place",
    "plan",
    "plan_cpu",
    "plan_many",
    "plan_to_json",
    "uses_gpus",
]
