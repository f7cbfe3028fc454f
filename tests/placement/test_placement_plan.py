"""Refusal reasons, bad input, quantization auto, determinism, the JSON contract, CPU and batch plans."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from placement.plan_fleets import example_fleet, node

from controlplane.catalog import Catalog, estimate
from controlplane.errors import UserError
from controlplane.placement import PlacementRequest, place, plan, plan_cpu, plan_many, plan_to_json
from controlplane.spec import (
    DeploymentSpec,
    EngineKind,
    Fleet,
    ModelSpec,
    Quantization,
    Shard,
    Strategy,
)

CAT = Catalog.load()


def spec(**kw: object) -> DeploymentSpec:
    return DeploymentSpec.model_validate({"name": "d", "model": "m", **kw})


# --- refusal reasons


def test_free_gpu_reason_names_node_count_and_memory() -> None:
    # The example: a node with 2 free A100-40GB and tp=4.
    fleet = Fleet(nodes=[node("gpu-3", "A100-40GB", 4, 40960)])
    placed = [Shard(node="gpu-3", gpus=[0, 1], pp_rank=0)]
    p = plan(fleet, spec(tp=4), CAT.get("llama-70b"), placed=placed)
    assert p.unplaced == 1
    need = estimate(CAT.get("llama-70b"), tp=4, gpu_memory_mib=40960).required_mib / 1024
    assert f"gpu-3: 2 free A100-40GB, tp=4 needs 4 GPUs with {need:.1f} GiB each" in "\n".join(p.reasons)
    assert "GPU 0: placed replica" in "\n".join(p.reasons)


def test_memory_reason_has_the_numbers() -> None:
    fleet = Fleet(nodes=[node("c1", "GeForce RTX 3080", 2, 10240)])
    p = plan(fleet, spec(tp=2, pp=1), CAT.get("llama-3-8b"))
    (line,) = [r for r in p.reasons if r.startswith("c1:")]
    assert "9.0 GiB usable per GPU (0.90 × 10.0 GiB)" in line
    assert "tp=2 pp=1 needs" in line
    assert "weights 7.5 GiB" in line


def test_memory_in_use_blocks_a_gpu() -> None:
    fleet = Fleet(nodes=[node("n1", "A100-80GB", 2, 81920, nvlink=True, used_mib={1: 20000})])
    p = plan(fleet, spec(tp=2), CAT.get("llama-3-8b"))
    assert p.unplaced == 1
    assert "GPU 1: 60.5 GiB free < 72.0 GiB" in "\n".join(p.reasons)
    assert plan(fleet, spec(tp=1), CAT.get("llama-3-8b")).replicas[0].shards[0].gpus == [0]


def test_selector_reason() -> None:
    p = plan(example_fleet(), spec(node_selector={"tier": "dev"}, tp=2), CAT.get("llama-70b"))
    text = "\n".join(p.reasons)
    assert "gpu-a1: labels tier=prod do not match node selector tier=dev" in text
    # The one dev node passes the selector but would need a 14-stage pipeline across 14 such nodes.
    assert "across nodes: 1 GeForce RTX 3080 node(s) have 2 free GPUs; tp=2 pp=14 needs 14 such nodes" in text


def test_partial_placement_counts_unplaced() -> None:
    p = plan(example_fleet(), spec(tp=8, replicas=3), CAT.get("llama-70b"))
    assert (len(p.replicas), p.unplaced) == (2, 1)
    assert p.reasons[0].startswith("1 of 3 replica(s) of llama-70b (tp=8")


def test_long_pipeline_across_many_small_nodes() -> None:
    # 70B on 15 GB T4s needs 20 stages: more than the planner's scoring window of nodes.
    fleet = Fleet(nodes=[node(f"n{i:03d}", "T4", 1, 15360) for i in range(30)])
    p = plan(fleet, spec(), CAT.get("llama-70b"))
    assert p.unplaced == 0
    (r,) = p.replicas
    assert r.pp == 20
    assert len({s.node for s in r.shards}) == 20


def test_empty_fleet() -> None:
    p = plan(Fleet(), spec(), CAT.get("llama-3-8b"))
    assert p.unplaced == 1
    assert "the fleet has no nodes" in p.reasons[1]


def test_long_reason_lists_are_capped() -> None:
    fleet = Fleet(nodes=[node(f"n{i:03d}", "T4", 1, 15360) for i in range(60)])
    p = plan(fleet, spec(tp=2), CAT.get("llama-3-8b"))
    assert len(p.reasons) <= 27
    assert p.reasons[-1].startswith("… and ")


# --- bad input


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"tp": 3},
            r"tp=3 does not divide llama-70b's 64 attention heads; use tp in \[1, 2, 4, 8, 16, 32, 64\]",
        ),
        ({"max_model_len": 100000}, "max_model_len 100000 exceeds llama-70b's context of 8192"),
    ],
)
def test_bad_input(kw: dict[str, object], message: str) -> None:
    with pytest.raises(UserError, match=message) as err:
        plan(example_fleet(), spec(**kw), CAT.get("llama-70b"))
    assert err.value.exit_code == 2


def test_missing_variant_is_bad_input() -> None:
    with pytest.raises(UserError, match="sarv-tiny has no awq variant"):
        plan(example_fleet(), spec(quantization=Quantization.AWQ), CAT.get("sarv-tiny"))


def test_kv_heads_must_divide_tp() -> None:
    odd = ModelSpec(
        name="odd",
        num_layers=4,
        hidden_size=768,
        num_attention_heads=12,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2048,
        vocab_size=1000,
        num_params=10**8,
        max_model_len=2048,
    )
    with pytest.raises(UserError, match="KV heads do not divide one another"):
        plan(example_fleet(), spec(tp=6), odd)


# --- quantization auto


def test_auto_keeps_full_precision_when_it_fits() -> None:
    p = plan(example_fleet(), spec(tp=2, quantization=Quantization.AUTO), CAT.get("llama-70b"))
    assert p.replicas[0].quantization is Quantization.NONE
    assert p.notes[0].startswith("quantization auto: chose none")


def test_auto_steps_down_and_says_why() -> None:
    # Two 8×80 GB nodes: 405B bf16 needs both for one replica; two replicas need fp8 (8 GPUs each).
    p = plan(
        example_fleet(), spec(tp=8, replicas=2, quantization=Quantization.AUTO), CAT.get("llama-3.1-405b")
    )
    assert p.unplaced == 0
    assert {r.quantization for r in p.replicas} == {Quantization.FP8}
    assert "chose fp8" in p.notes[0]
    assert "none placed only 1 of 2" in p.notes[0]


def test_auto_with_nothing_fitting_keeps_the_best() -> None:
    fleet = Fleet(nodes=[node("t1", "T4", 1, 15360)])
    p = plan(fleet, spec(quantization=Quantization.AUTO), CAT.get("llama-70b"))
    assert p.unplaced == 1
    assert "no variant places all" in p.notes[0]


# --- determinism and the contract


def test_same_input_same_plan_whatever_the_node_order() -> None:
    fleet = example_fleet()
    s = spec(tp=2, replicas=5)
    first = plan(fleet, s, CAT.get("llama-70b")).model_dump()
    assert plan(fleet, s, CAT.get("llama-70b")).model_dump() == first
    nodes = list(fleet.nodes)
    random.Random(7).shuffle(nodes)
    assert plan(Fleet(nodes=nodes), s, CAT.get("llama-70b")).model_dump() == first


def test_json_contract() -> None:
    p = plan(example_fleet(), spec(tp=2, replicas=8), CAT.get("llama-70b"))
    data = json.loads(json.dumps(plan_to_json(p)))
    assert list(data) == ["model", "replicas", "unplaced", "reasons"]
    assert data["model"] == "llama-70b"
    assert isinstance(data["unplaced"], int)
    assert all(isinstance(r, str) for r in data["reasons"])
    for r in data["replicas"]:
        assert list(r) == ["tp", "pp", "shards", "per_gpu_memory_gib", "max_concurrency"]
        assert isinstance(r["tp"], int) and isinstance(r["pp"], int)
        assert isinstance(r["per_gpu_memory_gib"], float) and isinstance(r["max_concurrency"], int)
        for s in r["shards"]:
            assert list(s) == ["node", "gpus", "pp_rank"]
            assert isinstance(s["node"], str) and all(isinstance(g, int) for g in s["gpus"])


# --- CPU engines


def test_cpu_engines_get_cpu_shards() -> None:
    # vllm-cpu: sim on this fleet of GPU nodes stands in for vllm (tests/placement/test_placement_place.py).
    s = spec(engine=EngineKind.VLLM_CPU, replicas=3, strategy=Strategy.SPREAD)
    p = place(example_fleet(), s, CAT.get("sarv-tiny"))
    assert p.unplaced == 0
    assert all(r.shards[0].gpus == [] for r in p.replicas)
    assert len({r.shards[0].node for r in p.replicas}) == 3


def test_plan_cpu_binpack_and_selector() -> None:
    fleet = example_fleet()
    placed = [Shard(node="svc-2", gpus=[], pp_rank=0)]
    p = plan_cpu(fleet, spec(engine=EngineKind.VLLM_CPU), placed)
    assert p.replicas[0].shards[0].node == "svc-2"  # the busiest node, binpack
    p = plan_cpu(fleet, spec(engine=EngineKind.VLLM_CPU, node_selector={"tier": "dev"}, replicas=2))
    assert [r.shards[0].node for r in p.replicas] == ["gpu-c1", "gpu-c1"]
    p = plan_cpu(fleet, spec(node_selector={"tier": "none"}))
    assert p.unplaced == 1
    assert "no node matches the node selector" in p.reasons[0]


def test_plan_cpu_on_this_host() -> None:
    p = plan_cpu(Fleet(nodes=[node("localhost", "x", 0, 1)]), spec(engine=EngineKind.SIM, replicas=2))
    assert [r.shards[0].node for r in p.replicas] == ["localhost", "localhost"]


# --- batch


def test_plan_many_shares_the_fleet_and_keeps_request_order() -> None:
    fleet = example_fleet()
    small = PlacementRequest(spec=spec(name="small", replicas=4), model=CAT.get("llama-3-8b"))
    big = PlacementRequest(spec=spec(name="big", tp=8, replicas=2), model=CAT.get("llama-70b"))
    plans = plan_many(fleet, [small, big])
    assert [p.deployment for p in plans] == ["small", "big"]
    # Largest first: both tp=8 replicas get whole 80 GB nodes although the small model was asked first.
    assert plans[1].unplaced == 0
    used = [(s.node, g) for p in plans for r in p.replicas for s in r.shards for g in s.gpus]
    assert len(used) == len(set(used))


# --- invariants over random fleets and requests

MODELS = ["llama-3-8b", "llama-70b", "mixtral-8x7b", "qwen2.5-72b", "llama-3.1-405b"]
TYPES = [
    ("H100-80GB", 81920, True),
    ("A100-40GB", 40960, False),
    ("L40S", 46068, False),
    ("A10", 24576, False),
]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(TYPES), st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=6),
    st.lists(
        st.tuples(st.sampled_from(MODELS), st.sampled_from([1, 2, 4, 8]), st.integers(1, 3)),
        min_size=1,
        max_size=5,
    ),
    st.sampled_from(list(Strategy)),
)
def test_plans_never_break_the_rules(
    nodes: list[tuple[tuple[str, int, bool], int]],
    requests: list[tuple[str, int, int]],
    strategy: Strategy,
) -> None:
    fleet = Fleet(nodes=[node(f"n{i}", t[0], count, t[1], nvlink=t[2]) for i, (t, count) in enumerate(nodes)])
    reqs = [
        PlacementRequest(spec=spec(name=f"d{i}", tp=tp, replicas=n, strategy=strategy), model=CAT.get(name))
        for i, (name, tp, n) in enumerate(requests)
    ]
    plans = plan_many(fleet, reqs)
    seen: set[tuple[str, int]] = set()
    for req, p in zip(reqs, plans, strict=True):
        assert len(p.replicas) + p.unplaced == req.spec.replicas
        assert bool(p.unplaced) == bool(p.reasons)
        for r in p.replicas:
            assert r.tp == req.spec.tp and len(r.shards) == r.pp
            assert [s.pp_rank for s in r.shards] == list(range(r.pp))
            kinds = set()
            for s in r.shards:
                assert len(s.gpus) == r.tp
                gpus = {g.index: g for g in fleet.node(s.node).gpus}
                kinds |= {(gpus[i].model, gpus[i].memory_total_mib) for i in s.gpus}
                for i in s.gpus:
                    assert (s.node, i) not in seen  # no GPU handed out twice
                    seen.add((s.node, i))
            assert len(kinds) == 1  # one GPU type per replica
            (_model, mib) = kinds.pop()
            est = estimate(req.model, tp=r.tp, pp=r.pp, gpu_memory_mib=mib, quantization=r.quantization)
            assert est.fits and r.per_gpu_memory_gib <= 0.9 * mib / 1024
            if len({s.node for s in r.shards}) > 1:
                assert len({s.node for s in r.shards}) == r.pp  # across nodes: one stage per node


def test_plan_many_does_not_let_an_expensive_fallback_starve_cheap_replicas() -> None:
    # Four 70B tp=2 replicas fill the 80 GB node; a fifth would need all eight A10s (pp=4). The batch
    # planner places every replica at its cheapest GPU count first, so the eight 8B replicas get the
    # A10s and only the fifth 70B is refused, with its reasons.
    fleet = Fleet(
        nodes=[
            node("big", "A100-SXM4-80GB", 8, 81920, nvlink=True),
            node("small", "A10", 8, 24576),
        ]
    )
    seventy = PlacementRequest(spec=spec(name="seventy", tp=2, replicas=5), model=CAT.get("llama-70b"))
    eight = PlacementRequest(spec=spec(name="eight", replicas=8), model=CAT.get("llama-3-8b"))
    p70, p8 = plan_many(fleet, [seventy, eight])
    assert (len(p70.replicas), p70.unplaced) == (4, 1)
    assert p70.reasons and "small: 0 free A10" in "\n".join(p70.reasons)
    assert (len(p8.replicas), p8.unplaced) == (8, 0)
    assert {r.shards[0].node for r in p8.replicas} == {"small"}
    # The same input gives the same plans.
    assert [p.model_dump() for p in plan_many(fleet, [seventy, eight])] == [p70.model_dump(), p8.model_dump()]
