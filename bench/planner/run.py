"""Planner benchmark: wall time and GPUs used on a generated 1,000-node fleet, against lower bounds and an
exact MILP (PuLP + HiGHS) on subsets of at most 50 nodes.

    .venv/bin/python bench/planner/run.py            # full run: bench/planner/results/planner.{json,md}
    .venv/bin/python bench/planner/run.py --quick    # smaller, for a smoke check

Needs the bench extra (``pip install -e '.[bench]'``) for the exact solver.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from controlplane.catalog import Catalog, estimate
from controlplane.placement import PlacementRequest, plan_many
from controlplane.spec import GPU, DeploymentSpec, Fleet, Interconnect, ModelSpec, Node, Plan, Quantization

RESULTS = Path(__file__).resolve().parent / "results"

# GPU types of the generated fleet: (model, MiB, NVLink, GPUs per PCIe switch, share of nodes).
GPU_TYPES = [
    ("H100-SXM5-80GB", 81559, True, 0, 0.25),
    ("A100-SXM4-80GB", 81920, True, 0, 0.20),
    ("A100-PCIE-40GB", 40960, False, 2, 0.20),
    ("L40S", 46068, False, 4, 0.20),
    ("A10", 24564, False, 2, 0.15),
]

# Replica requests: (model, tp, quantization, max_model_len or None, share of deployments).
REQUESTS = [
    ("llama-3-8b", 1, Quantization.NONE, None, 0.30),
    ("qwen2.5-7b", 1, Quantization.NONE, 16384, 0.10),
    ("llama-3.1-8b", 1, Quantization.NONE, 32768, 0.08),
    ("mixtral-8x7b", 2, Quantization.NONE, 8192, 0.10),
    ("llama-70b", 2, Quantization.NONE, None, 0.14),
    ("llama-70b", 4, Quantization.NONE, None, 0.08),
    ("qwen2.5-72b", 4, Quantization.NONE, 8192, 0.08),
    ("llama-70b", 2, Quantization.AWQ, None, 0.05),
    ("llama-3.1-405b", 8, Quantization.FP8, 16384, 0.04),
    ("llama-3.1-405b", 8, Quantization.NONE, 16384, 0.03),
]


def make_node(name: str, rng: random.Random) -> Node:
    model, mib, nvlink, per_switch, _ = rng.choices(GPU_TYPES, weights=[t[4] for t in GPU_TYPES])[0]
    gpus = [
        GPU(
            index=i,
            model=model,
            memory_total_mib=mib,
            nvlink_peers=[j for j in range(8) if j != i] if nvlink else [],
            pcie_switch=None if nvlink else f"sw{i // per_switch}",
            numa_node=i // 4,
        )
        for i in range(8)
    ]
    return Node(
        name=name,
        address=name,
        gpus=gpus,
        interconnect=Interconnect.NVLINK if nvlink else Interconnect.PCIE,
    )


def make_fleet(n: int, rng: random.Random, prefix: str = "node") -> Fleet:
    return Fleet(nodes=[make_node(f"{prefix}-{i:04d}", rng) for i in range(n)])


def make_requests(catalog: Catalog, replicas: int, rng: random.Random) -> list[PlacementRequest]:
    out: list[PlacementRequest] = []
    total = 0
    while total < replicas:
        model, tp, quant, length, _ = rng.choices(REQUESTS, weights=[r[4] for r in REQUESTS])[0]
        n = min(replicas - total, rng.choice([1, 1, 2, 2, 3, 4, 6, 8]))
        spec = DeploymentSpec(
            name=f"d{len(out):04d}",
            model=model,
            replicas=n,
            tp=tp,
            quantization=quant,
            max_model_len=length,
        )
        out.append(PlacementRequest(spec=spec, model=catalog.get(model)))
        total += n
    return out


# --- lower bounds and the exact solver


@dataclass(frozen=True)
class Option:
    """One GPU type a replica can use: pp stages of tp GPUs, each needing ``need_mib``."""

    gpu_type: tuple[str, int]
    pp: int
    gpus: int
    need_mib: float


def options(
    model: ModelSpec, spec: DeploymentSpec, types: set[tuple[str, int]], node_size: int
) -> list[Option]:
    """Smallest pp per GPU type at which the replica fits, as the planner computes it."""
    out = []
    for gpu_model, mib in sorted(types):
        for pp in range(1, model.num_layers + 1):
            est = estimate(
                model,
                tp=spec.tp,
                pp=pp,
                gpu_memory_mib=mib,
                quantization=spec.quantization,
                max_model_len=spec.max_model_len,
                concurrency=spec.concurrency,
                gpu_memory_utilization=spec.gpu_memory_utilization,
            )
            if est.fits:
                out.append(Option((gpu_model, mib), pp, spec.tp * pp, est.required_mib))
                break
    return out


def replica_list(requests: list[PlacementRequest], fleet: Fleet) -> list[tuple[int, list[Option]]]:
    types = {(g.model, g.memory_total_mib) for n in fleet.nodes for g in n.gpus}
    cache: dict[tuple[object, ...], list[Option]] = {}
    out = []
    for i, req in enumerate(requests):
        key = (req.model.name, req.spec.tp, req.spec.quantization, req.spec.max_model_len)
        if key not in cache:
            cache[key] = options(req.model, req.spec, types, 8)
        out.extend((i, cache[key]) for _ in range(req.spec.replicas))
    return out


def gpus_used(plans: list[Plan]) -> int:
    return sum(len(s.gpus) for p in plans for r in p.replicas for s in r.shards)


def lower_bounds(reps: list[tuple[int, list[Option]]], fleet: Fleet) -> tuple[int, int]:
    """(⌈Σ demand / capacity⌉, Σ per-replica minimum GPUs) over replicas that fit some GPU type.

    Demand is the memory a replica needs on its cheapest option; capacity the largest per-GPU budget.
    A GPU holds one shard only, so the per-replica minimum GPU count is the tighter bound."""
    capacity = max(0.9 * g.memory_total_mib for n in fleet.nodes for g in n.gpus)
    demand = sum(min(o.gpus * o.need_mib for o in opts) for _, opts in reps if opts)
    return math.ceil(demand / capacity), sum(min(o.gpus for o in opts) for _, opts in reps if opts)


def solve_exact(reps: list[tuple[int, list[Option]]], fleet: Fleet, time_limit: float) -> dict[str, object]:
    """MILP over the planner's own layouts (a replica whole on one node, or one tp-stage on each of pp
    nodes of one GPU type): maximise replicas placed, then minimise GPUs used."""
    import pulp

    nodes = [(n.name, (n.gpus[0].model, n.gpus[0].memory_total_mib), len(n.gpus)) for n in fleet.nodes]
    prob = pulp.LpProblem("placement", pulp.LpMaximize)
    placed_terms = []
    gpu_terms = []
    cap: dict[str, list[object]] = {name: [] for name, _, _ in nodes}
    per_replica: list[list[object]] = []
    for r, (_, opts) in enumerate(reps):
        choices = []
        for o in opts:
            tp = o.gpus // o.pp
            members = [(name, size) for name, t, size in nodes if t == o.gpu_type]
            if o.gpus <= 8:
                for name, size in members:
                    if o.gpus <= size:
                        a = pulp.LpVariable(f"a_{r}_{name}", cat="Binary")
                        choices.append(a)
                        cap[name].append(o.gpus * a)
                        gpu_terms.append(o.gpus * a)
            if o.pp >= 2 and len(members) >= o.pp:
                c = pulp.LpVariable(f"c_{r}_{o.gpu_type[0]}_{o.gpu_type[1]}", cat="Binary")
                choices.append(c)
                stages = []
                for name, _size in members:
                    b = pulp.LpVariable(f"b_{r}_{name}", cat="Binary")
                    stages.append(b)
                    cap[name].append(tp * b)
                    gpu_terms.append(tp * b)
                prob += pulp.lpSum(stages) == o.pp * c
        per_replica.append(choices)
        if choices:
            prob += pulp.lpSum(choices) <= 1
            placed_terms.extend(choices)
    for name, _, size in nodes:
        if cap[name]:
            prob += pulp.lpSum(cap[name]) <= size
    big = 10 * sum(size for _, _, size in nodes)
    prob += big * pulp.lpSum(placed_terms) - pulp.lpSum(gpu_terms)
    # Zero relative gap: with the big-M objective the default gap would hide tens of GPUs.
    solver = pulp.HiGHS(msg=False, timeLimit=time_limit, threads=1, gapRel=0.0, gapAbs=0.5)
    t0 = time.perf_counter()
    prob.solve(solver)
    elapsed = time.perf_counter() - t0
    placed = round(sum(v.value() or 0 for v in placed_terms))
    used = round(sum(pulp.value(t) or 0 for t in gpu_terms))
    unplaced = [r for r, ch in enumerate(per_replica) if round(sum(v.value() or 0 for v in ch)) == 0]  # type: ignore[attr-defined]
    return {
        "unplaced_replicas": unplaced,
        "status": pulp.LpStatus[prob.status],
        "placed": placed,
        "gpus": used,
        "seconds": round(elapsed, 2),
        "bound_exact": prob.status == pulp.LpStatusOptimal,
    }


# --- runs


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def pin_one_core() -> str:
    try:
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        return f"pinned to core {core}"
    except (AttributeError, OSError):
        return "not pinned"


def full_run(catalog: Catalog, nodes: int, replicas: int, repeats: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    fleet = make_fleet(nodes, rng)
    requests = make_requests(catalog, replicas, rng)
    times = []
    cpu_times = []
    plans: list[Plan] = []
    for _ in range(repeats):
        # Wall time and this process's CPU time: on a shared machine the CPU time is the fairer number.
        t0, c0 = time.perf_counter(), time.process_time()
        plans = plan_many(fleet, requests)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        progress(f"full run: {times[-1]:.3f} s wall, {cpu_times[-1]:.3f} s CPU")
    again = plan_many(fleet, requests)
    reps = replica_list(requests, fleet)
    lb_mem, lb_min = lower_bounds(reps, fleet)
    placed = sum(len(p.replicas) for p in plans)
    used = gpus_used(plans)
    # Per-replica minimum GPUs over the replicas the planner placed: what "used / LB" divides by.
    first_option = dict(reps)
    placed_min = sum(
        len(p.replicas) * min(o.gpus for o in first_option[i]) for i, p in enumerate(plans) if first_option[i]
    )
    return {
        "nodes": nodes,
        "gpus": sum(len(n.gpus) for n in fleet.nodes),
        "deployments": len(requests),
        "replicas": sum(r.spec.replicas for r in requests),
        "placed": placed,
        "unplaced": sum(p.unplaced for p in plans),
        "gpus_used": used,
        "lower_bound_memory": lb_mem,
        "lower_bound_min_gpus": lb_min,
        "nodes_touched": len({s.node for p in plans for r in p.replicas for s in r.shards}),
        "seconds_min": round(min(times), 3),
        "seconds_median": round(statistics.median(times), 3),
        "cpu_seconds_min": round(min(cpu_times), 3),
        "cpu_seconds_median": round(statistics.median(cpu_times), 3),
        "deterministic": [p.model_dump() for p in again] == [p.model_dump() for p in plans],
        "placed_min_gpus_bound": placed_min,
    }


def subset_run(catalog: Catalog, nodes: int, fill: float, seed: int, time_limit: float) -> dict[str, object]:
    rng = random.Random(seed)
    fleet = make_fleet(nodes, rng, prefix="s")
    capacity = sum(len(n.gpus) for n in fleet.nodes)
    # Ask for replicas until their minimum GPU demand reaches ``fill`` of the subset's GPUs.
    requests: list[PlacementRequest] = []
    demand = 0
    types = {(g.model, g.memory_total_mib) for n in fleet.nodes for g in n.gpus}
    while demand < fill * capacity:
        (req,) = make_requests(catalog, 1, rng)
        opts = options(req.model, req.spec, types, 8)
        if not opts:
            continue
        req = PlacementRequest(
            spec=req.spec.model_copy(update={"name": f"d{len(requests):04d}"}), model=req.model
        )
        requests.append(req)
        demand += min(o.gpus for o in opts)
    # Keep the instance tight but feasible: drop the last deployment until the exact solver places
    # every replica, so "missed" means the planner left out a replica that provably fits.
    trimmed = 0
    while True:
        reps = replica_list(requests, fleet)
        exact = solve_exact(reps, fleet, time_limit)
        progress(
            f"subset {seed}: {len(reps)} replicas, exact placed {exact['placed']} in {exact['seconds']} s"
        )
        if exact["placed"] == len(reps) or len(requests) == 1:
            break
        # Take out exactly the replicas the solver left unplaced: what remains provably fits (the
        # solver's own placement), and the next solve finds its GPU optimum.
        drop: dict[int, int] = {}
        for r in exact["unplaced_replicas"]:  # type: ignore[attr-defined]
            drop[reps[r][0]] = drop.get(reps[r][0], 0) + 1
        kept = []
        for i, req in enumerate(requests):
            n = req.spec.replicas - drop.get(i, 0)
            if n > 0:
                kept.append(
                    PlacementRequest(spec=req.spec.model_copy(update={"replicas": n}), model=req.model)
                )
        trimmed += sum(drop.values())
        requests = kept
    t0 = time.perf_counter()
    plans = plan_many(fleet, requests)
    planner_s = time.perf_counter() - t0
    placed = sum(len(p.replicas) for p in plans)
    used = gpus_used(plans)
    lb_mem, lb_min = lower_bounds(reps, fleet)
    return {
        "seed": seed,
        "nodes": nodes,
        "fill": fill,
        "replicas": len(reps),
        "gpus_total": capacity,
        "trimmed_replicas": trimmed,
        "planner_placed": placed,
        "planner_gpus": used,
        "planner_seconds": round(planner_s, 4),
        "exact_status": exact["status"],
        "exact_placed": exact["placed"],
        "exact_gpus": exact["gpus"],
        "exact_seconds": exact["seconds"],
        "lower_bound_memory": lb_mem,
        "lower_bound_min_gpus": lb_min,
        # Same number placed: compare GPUs. Fewer placed than the solver: a miss (the target is none).
        "gpu_ratio": round(used / exact["gpus"], 4) if exact["gpus"] and placed == exact["placed"] else None,
        "missed": max(0, int(exact["placed"]) - placed),  # type: ignore[call-overload]
    }


def table(full: dict[str, object], subsets: list[dict[str, object]]) -> str:
    ratio = int(full["gpus_used"]) / max(1, int(full["placed_min_gpus_bound"]))  # type: ignore[call-overload]
    lines = [
        "### Full fleet",
        "",
        "| nodes | GPUs | replicas | placed | unplaced | GPUs used | LB ⌈Σdemand/capacity⌉ | LB Σ min GPUs "
        "| used / LB | nodes touched | wall s (min / median) | CPU s (min / median) | deterministic |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {full['nodes']} | {full['gpus']} | {full['replicas']} | {full['placed']} | {full['unplaced']} "
        f"| {full['gpus_used']} | {full['lower_bound_memory']} | {full['lower_bound_min_gpus']} "
        f"| {ratio:.3f} | {full['nodes_touched']} "
        f"| {full['seconds_min']} / {full['seconds_median']} "
        f"| {full['cpu_seconds_min']} / {full['cpu_seconds_median']} | {full['deterministic']} |",
        "",
        "### Subsets against the exact MILP (HiGHS via PuLP)",
        "",
        "| seed | nodes | GPUs | replicas | planner placed | exact placed | planner GPUs | exact GPUs "
        "| ratio | missed | LB Σ min GPUs | solver status | planner s | solver s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in subsets:
        lines.append(
            f"| {s['seed']} | {s['nodes']} | {s['gpus_total']} | {s['replicas']} | {s['planner_placed']} "
            f"| {s['exact_placed']} | {s['planner_gpus']} | {s['exact_gpus']} | {s['gpu_ratio']} "
            f"| {s['missed']} | {s['lower_bound_min_gpus']} | {s['exact_status']} "
            f"| {s['planner_seconds']} | {s['exact_seconds']} |"
        )
    return "\n".join(lines)


def require_solver() -> None:
    """Stop with one line unless PuLP and its HiGHS backend (the bench extra) import."""
    for module in ("pulp", "highspy"):
        try:
            __import__(module)
        except ImportError:
            print(
                f"error: Python module {module} is not installed in {sys.prefix}; "
                "install it with `pip install -e '.[bench]'`",
                file=sys.stderr,
            )
            raise SystemExit(2) from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="200 nodes, 400 replicas, 3 subsets")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--solver-seconds", type=float, default=60.0)
    ap.add_argument("--subsets", type=int, default=8, help="how many exact-solver subsets to run (at most 8)")
    args = ap.parse_args()
    require_solver()
    pinned = pin_one_core()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    catalog = Catalog.load()
    if args.quick:
        full = full_run(catalog, 200, 400, 2, args.seed)
        specs = [(20, 0.9, args.seed + i) for i in range(3)]
    else:
        full = full_run(catalog, 1000, 2000, 5, args.seed)
        sizes = [(20, 0.8), (20, 0.95), (30, 0.9), (40, 0.85), (40, 1.0), (50, 0.9), (50, 0.97), (50, 1.1)]
        specs = [(n, f, args.seed + i) for i, (n, f) in enumerate(sizes)][: args.subsets]
    subsets = [subset_run(catalog, n, f, s, args.solver_seconds) for n, f, s in specs]
    ratios = [s["gpu_ratio"] for s in subsets if s["gpu_ratio"] is not None]
    summary = {
        "max_gpu_ratio_vs_exact": max(ratios) if ratios else None,  # type: ignore[type-var]
        "subsets_with_misses": sum(1 for s in subsets if s["missed"]),
        "targets": {"seconds": 1.0, "gpu_ratio": 1.02, "misses": 0},
    }
    result = {
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpu": pinned,
            "cores": os.cpu_count(),
            "load_average_at_start": round(load, 2),
        },
        "full": full,
        "subsets": subsets,
        "summary": summary,
    }
    text = table(full, subsets)
    print(text)
    print(json.dumps(summary, indent=2))
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "planner.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / "planner.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
