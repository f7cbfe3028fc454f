"""The one placement entry (``place``): GPU or CPU placement by engine and fleet, and the automatic engine."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from controlplane.placement._cpu import IsLocal, nowhere, plan_cpu
from controlplane.placement._planner import check_request, plan
from controlplane.spec import DeploymentSpec, EngineKind, Fleet, ModelSpec, Plan, Shard

__all__ = ["choose_engine", "place", "uses_gpus"]


def _matching(fleet: Fleet, spec: DeploymentSpec) -> list[str]:
    """Names of the nodes that match the node selector and declare GPUs."""
    return [
        n.name
        for n in fleet.nodes
        if n.gpus and all(n.labels.get(k) == v for k, v in spec.node_selector.items())
    ]


def uses_gpus(fleet: Fleet, spec: DeploymentSpec) -> bool:
    """Whether ``spec`` gets GPU placement on ``fleet``.

    ``vllm``: always. ``vllm-cpu``: never. ``sim`` stands in for ``vllm``: GPU placement when a node that
    matches the node selector declares GPUs (a rehearsal of the GPU deployment, GPU indices in the
    record), CPU placement otherwise (this host without GPUs, the embedded default).
    """
    if spec.engine is EngineKind.VLLM:
        return True
    if spec.engine is EngineKind.SIM:
        return bool(_matching(fleet, spec))
    return False


def choose_engine(fleet: Fleet) -> tuple[EngineKind, str]:
    """The engine ``--engine auto`` runs, and why: ``vllm`` when the fleet has GPUs, else ``vllm-cpu``."""
    if any(n.gpus for n in fleet.nodes):
        return EngineKind.VLLM, "GPUs found"
    return EngineKind.VLLM_CPU, "no GPU in the fleet"


def place(
    fleet: Fleet,
    spec: DeploymentSpec,
    model: ModelSpec,
    placed: Sequence[Shard] = (),
    *,
    is_local: IsLocal = nowhere,
    local_cpus: int | None = None,
    avoid_nodes: Collection[str] = (),
    explain: bool = False,
) -> Plan:
    """Place ``spec``'s replicas of ``model`` on ``fleet`` around the ``placed`` shards: what ``llmctl plan``
    prints and ``llmctl deploy`` records.

    GPU placement (:func:`plan`) where :func:`uses_gpus` says so, else CPU placement (:func:`plan_cpu`,
    which asks ``is_local`` which nodes are this host and checks ``local_cpus`` there). Input that can
    never work raises ``UserError`` (exit 2) either way. ``avoid_nodes`` are nodes that already run
    replicas of this deployment; ``explain`` adds each refused node's reason to a GPU plan's notes.
    """
    if uses_gpus(fleet, spec):
        return plan(fleet, spec, model, placed, avoid_nodes=avoid_nodes, explain=explain)
    check_request(spec, model)
    return plan_cpu(fleet, spec, placed, is_local=is_local, local_cpus=local_cpus, avoid_nodes=avoid_nodes)
