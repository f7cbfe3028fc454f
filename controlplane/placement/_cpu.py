"""CPU placement: replicas of engines that use no GPU (``vllm-cpu``, and ``sim`` without GPUs)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from controlplane.spec import (
    DeploymentSpec,
    EngineKind,
    Fleet,
    Node,
    Plan,
    Quantization,
    ReplicaPlan,
    Shard,
    Strategy,
)

__all__ = ["IsLocal", "nowhere", "plan_cpu"]

IsLocal = Callable[[Node], bool]
"""Answers "is this node this host?"; the caller knows (``launchers.is_local_node``), placement does not."""


def nowhere(node: Node) -> bool:
    """The ``is_local`` of a caller that runs on none of the fleet's nodes."""
    del node
    return False


def plan_cpu(
    fleet: Fleet,
    spec: DeploymentSpec,
    placed: Sequence[Shard] = (),
    *,
    is_local: IsLocal = nowhere,
    local_cpus: int | None = None,
    avoid_nodes: Collection[str] = (),
) -> Plan:
    """Each replica at the requested tp × pp, all its stages on one node with ``gpus=[]``; no memory check.

    Nodes: those matching the node selector; of them only the ones that are this host (``is_local``)
    when there are any (the embedded default runs replicas as local processes), else all of them (systemd
    units over SSH). Among those: nodes not yet running this deployment first, then binpack (the node
    with most replicas) or spread (fewest), then node name. Every replica records the requested tp and
    pp, its pp stages all on its node: what the engine is launched with. ``local_cpus`` is this host's
    core count: a ``vllm-cpu`` replica on this host needs one core per worker.
    """
    pp = spec.pp or 1
    matching = [n for n in fleet.nodes if all(n.labels.get(k) == v for k, v in spec.node_selector.items())]
    here = [n for n in matching if is_local(n)]
    nodes = here or matching
    head = f"{spec.replicas} replica(s) of {spec.model} could not be placed"
    if not nodes:
        why = "the fleet has no nodes" if not fleet.nodes else "no node matches the node selector"
        return _refused(spec, [f"{head}: {why}"])
    workers = spec.tp * pp
    if here and spec.engine is EngineKind.VLLM_CPU and local_cpus is not None and workers > local_cpus:
        return _refused(
            spec,
            [f"{head}: tp×pp = {workers} vllm-cpu workers need {workers} cores; this host has {local_cpus}"],
        )
    load = {n.name: 0 for n in nodes}
    for shard in placed:
        if shard.node in load and shard.pp_rank == 0:
            load[shard.node] += 1
    used = set(avoid_nodes)
    quant = Quantization.NONE if spec.quantization is Quantization.AUTO else spec.quantization
    sign = -1 if spec.strategy is Strategy.BINPACK else 1
    replicas: list[ReplicaPlan] = []
    for _ in range(spec.replicas):
        # Nodes without this deployment first, then most (binpack) or fewest (spread) replicas, then
        # name, so the same input gives the same plan.
        name = min(load, key=lambda n: (n in used, sign * load[n], n))
        load[name] += 1
        used.add(name)
        replicas.append(
            ReplicaPlan(
                tp=spec.tp,
                pp=pp,
                quantization=quant,
                shards=[Shard(node=name, gpus=[], pp_rank=rank) for rank in range(pp)],
                per_gpu_memory_gib=0.0,
                max_concurrency=spec.concurrency,
            )
        )
    where = "this host" if here else "the fleet's nodes"
    return Plan(
        model=spec.model,
        deployment=spec.name,
        replicas=replicas,
        notes=[f"engine {spec.engine.value} runs on the CPUs of {where}: no GPU memory check"],
    )


def _refused(spec: DeploymentSpec, reasons: list[str]) -> Plan:
    return Plan(model=spec.model, deployment=spec.name, unplaced=spec.replicas, reasons=reasons)
