"""Pipeline parallelism: spill-over in one node, then across nodes of one GPU type; a given --pp."""

from __future__ import annotations

import pytest
from placement.plan_fleets import example_fleet, node

from controlplane.catalog import Catalog
from controlplane.errors import UserError
from controlplane.placement import plan
from controlplane.spec import DeploymentSpec, Fleet


@pytest.fixture(scope="module")
def cat() -> Catalog:
    return Catalog.load()


def spec(**kw: object) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "d", "model": "m", **kw})


def layout(p: object) -> list[list[tuple[str, list[int], int]]]:
    return [[(s.node, s.gpus, s.pp_rank) for s in r.shards] for r in p.replicas]  # type: ignore[attr-defined]


def test_pp_grows_inside_one_node(cat: Catalog) -> None:
    # Mixtral at tp=2 needs 48 GiB per GPU: a 40 GB box needs pp=2, which fits its 4 GPUs.
    fleet = Fleet(nodes=[node("b1", "A100-PCIE-40GB", 4, 40960, per_switch=2)])
    p = plan(fleet, spec(tp=2), cat.get("mixtral-8x7b"))
    assert p.unplaced == 0
    (r,) = p.replicas
    assert (r.tp, r.pp) == (2, 2)
    assert layout(p) == [[("b1", [0, 1], 0), ("b1", [2, 3], 1)]]
    assert r.per_gpu_memory_gib <= 0.9 * 40
    assert any("pp=1 would need" in n for n in p.notes)


def test_pp_spills_across_nodes_of_the_same_type(cat: Catalog) -> None:
    # 405B bf16 at tp=8 needs pp=2: 16 GPUs, so two 8-GPU nodes with tp GPUs each (vLLM's layout).
    fleet = Fleet(nodes=[node(f"a{i}", "A100-SXM4-80GB", 8, 81920, nvlink=True) for i in (1, 2, 3)])
    p = plan(fleet, spec(tp=8), cat.get("llama-3.1-405b"))
    assert p.unplaced == 0
    (r,) = p.replicas
    assert (r.tp, r.pp) == (8, 2)
    shards = layout(p)[0]
    assert [s[2] for s in shards] == [0, 1]
    assert len({s[0] for s in shards}) == 2
    assert all(s[1] == list(range(8)) for s in shards)
    assert any("across nodes" in n for n in p.notes)


def test_across_nodes_never_mixes_gpu_types(cat: Catalog) -> None:
    # One 80 GB and one 40 GB node: tp=4 llama-70b fits on one 40 GB stage only with pp>=2, and pp=2
    # across these two nodes would mix types, which vLLM cannot balance: only the 80 GB node is used.
    fleet = Fleet(
        nodes=[
            node("a1", "A100-SXM4-80GB", 4, 81920, nvlink=True),
            node("b1", "A100-PCIE-40GB", 4, 40960),
        ]
    )
    p = plan(fleet, spec(tp=4, replicas=3, max_model_len=8192, concurrency=4), cat.get("llama-70b"))
    for r in p.replicas:
        types = {fleet.node(s.node).gpus[0].model for s in r.shards}
        assert len(types) == 1


def test_one_node_is_tried_before_crossing_nodes(cat: Catalog) -> None:
    # Mixtral at tp=2: pp=1 fits an 80 GB pair, pp=2 is needed on 40 GB GPUs. The smallest pp in one
    # node comes first, then a larger pp in one node, and only then a pipeline across nodes.
    fleet = Fleet(
        nodes=[
            node("a1", "A100-SXM4-80GB", 2, 81920, nvlink=True),
            node("b1", "A100-PCIE-40GB", 4, 40960),
            node("b2", "A100-PCIE-40GB", 2, 40960),
            node("b3", "A100-PCIE-40GB", 2, 40960),
        ]
    )
    p = plan(fleet, spec(tp=2, replicas=3), cat.get("mixtral-8x7b"))
    assert p.unplaced == 0
    got = layout(p)
    assert got[0] == [("a1", [0, 1], 0)]  # pp=1 where it fits
    assert got[1] == [("b1", [0, 1], 0), ("b1", [2, 3], 1)]  # then pp=2 inside one node
    assert {s[0] for s in got[2]} == {"b2", "b3"}  # only then across nodes


def test_user_pp_is_honoured(cat: Catalog) -> None:
    fleet = Fleet(nodes=[node("a1", "A100-SXM4-80GB", 8, 81920, nvlink=True)])
    p = plan(fleet, spec(tp=2, pp=2), cat.get("llama-70b"))
    (r,) = p.replicas
    assert (r.tp, r.pp) == (2, 2)
    assert [len(s.gpus) for s in r.shards] == [2, 2]


def test_user_pp_is_refused_with_numbers(cat: Catalog) -> None:
    p = plan(example_fleet(), spec(tp=8, pp=1), cat.get("llama-3.1-405b"))
    assert p.unplaced == 1
    assert p.replicas == []
    line = next(r for r in p.reasons if r.startswith("gpu-a1:"))
    assert "72.0 GiB usable per GPU" in line
    assert "tp=8 pp=1 needs 105.5 GiB each" in line


def test_user_pp_across_nodes(cat: Catalog) -> None:
    fleet = Fleet(nodes=[node(f"a{i}", "A100-SXM4-80GB", 4, 81920, nvlink=True) for i in (1, 2)])
    p = plan(fleet, spec(tp=4, pp=2), cat.get("llama-70b"))
    assert [(s.node, s.pp_rank) for s in p.replicas[0].shards] == [("a1", 0), ("a2", 1)]


def test_pp_beyond_layers_is_bad_input(cat: Catalog) -> None:
    with pytest.raises(UserError, match="pp=3 exceeds sarv-tiny's 2 layers"):
        plan(example_fleet(), spec(pp=3), cat.get("sarv-tiny"))
