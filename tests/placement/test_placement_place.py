"""``place``: which placement an engine gets (GPU or CPU), CPU placement on this host or the fleet, and
the automatic engine."""

from __future__ import annotations

import pytest
from placement.plan_fleets import example_fleet, node

from controlplane.catalog import Catalog
from controlplane.errors import UserError
from controlplane.placement import choose_engine, place, plan_to_json, uses_gpus
from controlplane.spec import DeploymentSpec, EngineKind, Fleet, Node, Shard

CAT = Catalog.load()
TINY = CAT.get("sarv-tiny")


def spec(**kw: object) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "d", "model": "sarv-tiny", **kw})


def is_here(n: Node) -> bool:
    return n.name == "this-host"


def this_host(gpus: int = 0) -> Node:
    return node("this-host", "A100-SXM4-80GB", gpus, 81920, nvlink=True)


# --- sim: GPU placement on declared GPUs, CPU placement without


def test_sim_on_a_gpu_fleet_is_placed_like_vllm() -> None:
    s = spec(engine=EngineKind.SIM, tp=2, replicas=2)
    sim = place(example_fleet(), s, TINY)
    vllm = place(example_fleet(), s.model_copy(update={"engine": EngineKind.VLLM}), TINY)
    assert plan_to_json(sim) == plan_to_json(vllm)
    assert all(len(r.shards[0].gpus) == 2 for r in sim.replicas)
    assert sim.replicas[0].per_gpu_memory_gib > 0


def test_sim_without_gpus_is_placed_on_cpu_as_before() -> None:
    # The embedded default: this host alone, no GPU.
    p = place(Fleet(nodes=[this_host()]), spec(engine=EngineKind.SIM, replicas=2), TINY, is_local=is_here)
    assert p.unplaced == 0
    assert [(r.shards[0].node, r.shards[0].gpus) for r in p.replicas] == [("this-host", [])] * 2


def test_sim_follows_the_node_selector() -> None:
    # Only CPU nodes match: CPU placement although other nodes have GPUs.
    fleet = example_fleet()
    fleet.nodes[5].labels["role"] = "svc"
    s = spec(engine=EngineKind.SIM, node_selector={"role": "svc"})
    assert not uses_gpus(fleet, s)
    assert [(r.shards[0].node, r.shards[0].gpus) for r in place(fleet, s, TINY).replicas] == [("svc-1", [])]
    assert uses_gpus(fleet, s.model_copy(update={"node_selector": {"tier": "dev"}}))


def test_sim_on_this_host_with_declared_gpus_gets_its_gpus() -> None:
    p = place(Fleet(nodes=[this_host(gpus=2)]), spec(engine=EngineKind.SIM), TINY, is_local=is_here)
    assert [(s.node, s.gpus) for s in p.replicas[0].shards] == [("this-host", [0])]


def test_gpus_held_by_a_sim_replica_are_not_free_for_vllm() -> None:
    fleet = Fleet(nodes=[node("g", "A100-SXM4-80GB", 2, 81920, nvlink=True)])
    sim = place(fleet, spec(name="rehearsal", engine=EngineKind.SIM, tp=2), TINY)
    held = [s for r in sim.replicas for s in r.shards]
    assert held == [Shard(node="g", gpus=[0, 1], pp_rank=0)]
    assert place(fleet, spec(engine=EngineKind.VLLM), TINY, held).unplaced == 1


# --- CPU placement


def test_vllm_cpu_records_the_requested_tp_and_pp_on_a_remote_fleet() -> None:
    fleet = Fleet(nodes=[Node(name="cpu-1", address="10.0.0.1"), Node(name="cpu-2", address="10.0.0.2")])
    p = place(fleet, spec(engine=EngineKind.VLLM_CPU, tp=2, pp=2, replicas=2), TINY, local_cpus=1)
    assert p.unplaced == 0
    assert [(r.tp, r.pp) for r in p.replicas] == [(2, 2), (2, 2)]
    # One node per replica (all its stages there), nodes without this deployment first.
    assert [[(s.node, s.pp_rank) for s in r.shards] for r in p.replicas] == [
        [("cpu-1", 0), ("cpu-1", 1)],
        [("cpu-2", 0), ("cpu-2", 1)],
    ]


def test_cpu_replicas_stay_on_this_host_when_it_is_in_the_fleet() -> None:
    fleet = Fleet(nodes=[Node(name="cpu-1", address="10.0.0.1"), this_host()])
    p = place(fleet, spec(engine=EngineKind.VLLM_CPU, replicas=2), TINY, is_local=is_here)
    assert [r.shards[0].node for r in p.replicas] == ["this-host", "this-host"]
    # Without an answer about this host, every node is a candidate.
    anywhere = place(fleet, spec(engine=EngineKind.VLLM_CPU, replicas=2), TINY)
    assert [r.shards[0].node for r in anywhere.replicas] == ["cpu-1", "this-host"]


def test_vllm_cpu_needs_a_core_per_worker_on_this_host() -> None:
    fleet = Fleet(nodes=[this_host()])
    s = spec(engine=EngineKind.VLLM_CPU, tp=2, pp=2)
    p = place(fleet, s, TINY, is_local=is_here, local_cpus=3)
    assert p.unplaced == 1
    assert "tp×pp = 4 vllm-cpu workers need 4 cores; this host has 3" in p.reasons[0]
    assert place(fleet, s, TINY, is_local=is_here, local_cpus=4).unplaced == 0


def test_cpu_input_that_can_never_work_is_refused() -> None:
    with pytest.raises(UserError, match="tp=3 does not divide sarv-tiny's 4 attention heads"):
        place(Fleet(nodes=[this_host()]), spec(engine=EngineKind.VLLM_CPU, tp=3), TINY)
    with pytest.raises(UserError, match="pp=3 exceeds sarv-tiny's 2 layers"):
        place(Fleet(nodes=[this_host()]), spec(engine=EngineKind.SIM, pp=3), TINY)


# --- the automatic engine


def test_choose_engine() -> None:
    assert choose_engine(example_fleet()) == (EngineKind.VLLM, "GPUs found")
    assert choose_engine(Fleet(nodes=[this_host()])) == (EngineKind.VLLM_CPU, "no GPU in the fleet")
