"""TP groups stay in a node and prefer NVLink, then one PCIe switch, then one NUMA node; strategies."""

from __future__ import annotations

import pytest
from placement.plan_fleets import example_fleet, node

from controlplane.catalog import Catalog
from controlplane.placement import link_name, plan
from controlplane.spec import GPU, DeploymentSpec, Fleet, Interconnect, ModelSpec, Node, Shard, Strategy


@pytest.fixture(scope="module")
def llama8b() -> ModelSpec:
    return Catalog.load().get("llama-3-8b")


@pytest.fixture(scope="module")
def llama70b() -> ModelSpec:
    return Catalog.load().get("llama-70b")


def spec(**kw: object) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "d", "model": "m", **kw})


def gpus_of(p: object) -> list[tuple[str, list[int]]]:
    return [(s.node, s.gpus) for r in p.replicas for s in r.shards]  # type: ignore[attr-defined]


def test_prefers_nvlink_pair(llama8b: ModelSpec) -> None:
    # An 8-GPU PCIe box where only GPUs 5 and 6 are bridged with NVLink.
    gpus = [
        GPU(
            index=i,
            model="L40S",
            memory_total_mib=46068,
            nvlink_peers=[6] if i == 5 else [5] if i == 6 else [],
            pcie_switch=f"sw{i // 4}",
            numa_node=i // 4,
        )
        for i in range(8)
    ]
    fleet = Fleet(nodes=[Node(name="n1", address="n1", gpus=gpus)])
    p = plan(fleet, spec(tp=2), llama8b)
    assert gpus_of(p) == [("n1", [5, 6])]
    assert link_name(fleet.nodes[0], [5, 6]) == "nvlink"


def test_prefers_same_pcie_switch_then_numa(llama8b: ModelSpec) -> None:
    # Switches of two GPUs, NUMA nodes of four; GPU 1 is taken, so 0 has no switch partner left.
    fleet = Fleet(nodes=[node("n1", "A10", 8, 24576, per_switch=2, numa_nodes=2)])
    p = plan(fleet, spec(tp=2), llama8b, placed=[Shard(node="n1", gpus=[1], pp_rank=0)])
    (where,) = gpus_of(p)
    assert where[1] in ([2, 3], [4, 5], [6, 7])
    assert link_name(fleet.nodes[0], where[1]) == "pcie-switch"
    # All switches broken up: a pair on one NUMA node beats a pair across them.
    taken = [Shard(node="n1", gpus=[1, 3, 5, 7], pp_rank=0)]
    (where,) = gpus_of(plan(fleet, spec(tp=2), llama8b, placed=taken))
    assert where[1] in ([0, 2], [4, 6])
    assert link_name(fleet.nodes[0], where[1]) == "numa"


def test_single_gpu_leaves_switch_pairs_whole(llama8b: ModelSpec) -> None:
    fleet = Fleet(nodes=[node("n1", "A10", 4, 24576, per_switch=2)])
    p1 = plan(fleet, spec(tp=1), llama8b, placed=[Shard(node="n1", gpus=[0], pp_rank=0)])
    # GPU 1 is alone behind its switch now; taking it keeps 2 and 3 together for a later tp=2.
    assert gpus_of(p1) == [("n1", [1])]


def test_tp_group_never_crosses_nodes(llama70b: ModelSpec) -> None:
    # Two 2-GPU 80 GB nodes: tp=4 would fit by memory only across them, which is refused.
    fleet = Fleet(nodes=[node(f"n{i}", "H100-80GB", 2, 81920, nvlink=True) for i in (1, 2)])
    p = plan(fleet, spec(tp=4), llama70b)
    assert p.unplaced == 1
    assert any("a TP group stays inside one node and the largest node has 2 GPUs" in r for r in p.reasons)


def test_binpack_fills_the_fuller_node(llama8b: ModelSpec) -> None:
    fleet = Fleet(nodes=[node(f"n{i}", "A100-80GB", 8, 81920, nvlink=True) for i in (1, 2, 3)])
    placed = [Shard(node="n2", gpus=[0, 1, 2, 3, 4], pp_rank=0)]
    p = plan(fleet, spec(tp=2), llama8b, placed=placed)
    assert gpus_of(p) == [("n2", [5, 6])]


def test_spread_takes_the_emptiest_node(llama8b: ModelSpec) -> None:
    fleet = Fleet(nodes=[node(f"n{i}", "A100-80GB", 8, 81920, nvlink=True) for i in (1, 2, 3)])
    placed = [Shard(node="n1", gpus=[0], pp_rank=0), Shard(node="n2", gpus=[0, 1], pp_rank=0)]
    p = plan(fleet, spec(tp=2, strategy=Strategy.SPREAD), llama8b, placed=placed)
    assert [n for n, _ in gpus_of(p)] == ["n3"]


def test_replicas_prefer_different_nodes(llama8b: ModelSpec) -> None:
    fleet = Fleet(nodes=[node(f"n{i}", "A100-80GB", 8, 81920, nvlink=True) for i in (1, 2, 3)])
    p = plan(fleet, spec(tp=1, replicas=3), llama8b)
    assert sorted(n for n, _ in gpus_of(p)) == ["n1", "n2", "n3"]
    # With more replicas than nodes they double up, binpacked, instead of failing.
    p = plan(fleet, spec(tp=1, replicas=5), llama8b)
    assert p.unplaced == 0
    assert sorted({n for n, _ in gpus_of(p)}) == ["n1", "n2", "n3"]


def test_avoid_nodes_is_soft_anti_affinity(llama8b: ModelSpec) -> None:
    fleet = Fleet(nodes=[node(f"n{i}", "A100-80GB", 8, 81920, nvlink=True) for i in (1, 2)])
    assert [n for n, _ in gpus_of(plan(fleet, spec(), llama8b, avoid_nodes=["n1"]))] == ["n2"]
    assert [n for n, _ in gpus_of(plan(fleet, spec(), llama8b, avoid_nodes=["n1", "n2"]))] == ["n1"]


def test_small_model_goes_to_the_smaller_gpu(llama8b: ModelSpec) -> None:
    fleet = example_fleet()
    p = plan(fleet, spec(tp=1), llama8b)
    # 18 GiB fits a 40 GB A100 better than an 80 GB one; the 80 GB GPUs stay for 70B models.
    assert gpus_of(p)[0][0] in ("gpu-b1", "gpu-b2")


def test_inventory_without_peer_lists_counts_as_nvswitch() -> None:
    n = Node(
        name="n",
        address="n",
        interconnect=Interconnect.NVLINK,
        gpus=[GPU(index=i, model="H100", memory_total_mib=81920) for i in range(4)],
    )
    assert link_name(n, [0, 3]) == "nvlink"


def test_custom_scorers_plug_into_the_pipeline(llama8b: ModelSpec) -> None:
    """A Scorer is any object with name, weight and score(): here one that wants the last node by name."""
    from controlplane.placement import Candidate, PlacementContext, Planner

    class LastNode:
        name = "last-node"
        weight = 1.0

        def score(self, candidate: Candidate, ctx: PlacementContext) -> float:
            return int(candidate.stages[0][0].name[1:]) / 3

    fleet = Fleet(nodes=[node(f"n{i}", "A100-80GB", 8, 81920, nvlink=True) for i in (1, 2, 3)])
    default = Planner(fleet).plan(spec(), llama8b)
    custom = Planner(fleet, scorers=[LastNode()]).plan(spec(), llama8b)
    assert default.replicas[0].shards[0].node == "n1"
    assert custom.replicas[0].shards[0].node == "n3"
