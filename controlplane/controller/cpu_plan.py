"""Placement for engines that need no GPU (``vllm-cpu``, ``sim``): replicas on this host's CPU."""

from __future__ import annotations

import os
from collections.abc import Callable

from controlplane.errors import UserError
from controlplane.launchers import is_local_node
from controlplane.spec import (
    DeploymentSpec,
    EngineKind,
    Fleet,
    ModelSpec,
    Plan,
    ReplicaPlan,
    ReplicaRecord,
    Shard,
)

__all__ = ["cpu_plan"]


def cpu_plan(
    fleet: Fleet,
    spec: DeploymentSpec,
    model: ModelSpec,
    placed: list[ReplicaRecord],
    *,
    cpu_count: Callable[[], int | None] = os.cpu_count,
) -> Plan:
    """Place every replica on the first matching node this host can launch on, with reasons if none.

    CPU replicas share the host's cores rather than owning devices, so several fit on one node; the
    limits are the model's head count (tp must divide it) and, for vllm-cpu, one core per worker.
    """
    del placed  # CPU replicas do not reserve devices
    pp = spec.pp or 1
    reasons: list[str] = []
    if model.num_attention_heads % spec.tp:
        # Input that can never work is the user's mistake (exit 2), as in the GPU planner.
        raise UserError(
            f"tp={spec.tp} does not divide {model.name}'s {model.num_attention_heads} attention heads",
            hint="use a tp that divides the head count",
        )
    if pp > model.num_layers:
        raise UserError(f"pp={pp} exceeds {model.name}'s {model.num_layers} layers")
    cores = cpu_count() or 1
    if spec.engine is EngineKind.VLLM_CPU and spec.tp * pp > cores:
        reasons.append(
            f"tp×pp = {spec.tp * pp} vllm-cpu workers need {spec.tp * pp} cores; this host has {cores}"
        )
    nodes = [
        n
        for n in fleet.nodes
        if is_local_node(n) and all(n.labels.get(k) == v for k, v in spec.node_selector.items())
    ]
    if not nodes:
        reasons.append("no node of the fleet is this host (CPU engines run on this host only)")
    if reasons:
        return Plan(model=model.name, deployment=spec.name, unplaced=spec.replicas, reasons=reasons)
    node = nodes[0]
    replicas = [
        ReplicaPlan(
            tp=spec.tp,
            pp=pp,
            quantization=spec.quantization,
            shards=[Shard(node=node.name, gpus=[], pp_rank=r) for r in range(pp)],
            per_gpu_memory_gib=0.0,
            max_concurrency=spec.concurrency,
        )
        for _ in range(spec.replicas)
    ]
    return Plan(
        model=model.name,
        deployment=spec.name,
        replicas=replicas,
        notes=[f"{spec.engine.value} runs on the CPU of {node.name}; no GPU is used"],
    )
