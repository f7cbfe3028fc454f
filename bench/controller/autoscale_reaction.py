"""Autoscaling reaction and flapping, in simulated time: Sarv's policy against a naive one, same load.

A deployment of replicas, each with ``--slots`` concurrent sequences and a fixed service time, fed by a
seeded Poisson arrival process through one FIFO queue (the gateway's least-load routing to vLLM's
queues, folded into one). The controller runs every ``--period`` seconds of simulated time and applies
its decision at once; a new replica serves after ``--load-s`` seconds of loading. Queue waits are
recorded in each replica's histogram with vLLM's buckets, as ``vllm:request_queue_time_seconds`` would.

Scenarios: a load step crossing the target (reaction: first scale-up decision after the true queue-wait
p90 of the last period first passes 200 ms), a steady load and an oscillating one (decisions counted;
flapping = a scale-down followed by a scale-up or the reverse). Policies: Sarv's ``decide`` with its
defaults, and a naive baseline that sizes on the instantaneous requests per replica with no window,
delay or stabilisation.

    python bench/controller/autoscale_reaction.py [--seed 1] [--out bench/controller/results]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from controlplane.controller.autoscale import (  # noqa: E402 - after the path set-up
    AutoscaleConfig,
    AutoscaleContext,
    PolicyState,
    ReplicaLoad,
    decide,
)
from controlplane.engines.metrics import HistogramSample  # noqa: E402

# vllm/v1/metrics/buckets.py request_latency (queue time) buckets, as the simulator exports them.
_BOUNDS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0, float("inf"),
)  # fmt: skip
_DT = 0.05
_TARGET_S = 0.2


@dataclass
class Replica:
    rid: str
    ready_at: float
    running: list[float] = field(default_factory=list)
    """End times of the requests it runs."""
    counts: list[int] = field(default_factory=lambda: [0] * len(_BOUNDS))
    total: float = 0.0

    def observe(self, wait: float) -> None:
        for i, bound in enumerate(_BOUNDS):
            if wait <= bound:
                self.counts[i] += 1
                break
        self.total += wait

    def histogram(self) -> HistogramSample:
        cumulative, running = [], 0
        for n in self.counts:
            running += n
            cumulative.append(float(running))
        return HistogramSample(_BOUNDS, tuple(cumulative), self.total)


Policy = Callable[[float, list[Replica], int, float], int]
"""(now, replicas, waiting, …) → replicas wanted."""


class SarvPolicy:
    def __init__(self, cfg: AutoscaleConfig, low: int, high: int) -> None:
        self.cfg, self.low, self.high = cfg, low, high
        self.state = PolicyState()
        self.reasons: list[str] = []

    def __call__(self, now: float, replicas: list[Replica], waiting: int, slots: float) -> int:
        ready = [r for r in replicas if r.ready_at <= now]
        share = waiting / len(ready) if ready else 0.0
        loads = tuple(
            ReplicaLoad(r.rid, loading=True)
            if r.ready_at > now
            else ReplicaLoad(
                r.rid,
                ongoing=len(r.running) + share,
                kv_cache_usage=len(r.running) / slots,
                queue=r.histogram(),
            )
            for r in replicas
        )
        ctx = AutoscaleContext("bench", self.cfg, self.low, self.high, loads, now)
        decision, self.state = decide(ctx, self.state)
        if decision.recommended != decision.current:
            self.reasons.append(f"{now:.0f}s {decision.current}->{decision.recommended}: {decision.reason}")
            self.state = PolicyState()  # as the controller does after applying a change
        return decision.recommended


class NaivePolicy:
    """Desired = ceil(instantaneous waiting + running / target), applied every period."""

    def __init__(self, target: float, low: int, high: int) -> None:
        self.target, self.low, self.high = target, low, high

    def __call__(self, now: float, replicas: list[Replica], waiting: int, slots: float) -> int:
        ongoing = waiting + sum(len(r.running) for r in replicas)
        return max(self.low, min(self.high, math.ceil(ongoing / self.target)))


@dataclass
class Run:
    decisions: list[tuple[float, int, int]] = field(default_factory=list)
    """(time, from, to)."""
    crossed_at: float | None = None
    replicas_over_time: list[tuple[float, int]] = field(default_factory=list)
    p90_over_time: list[tuple[float, float]] = field(default_factory=list)
    failed: int = 0
    served: int = 0


def simulate(
    rate: Callable[[float], float],
    policy: Policy,
    *,
    duration: float,
    start: int,
    slots: int,
    service_s: float,
    period_s: float,
    load_s: float,
    seed: int,
    watch_from: float = 0.0,
) -> Run:
    rng = random.Random(seed)
    replicas = [Replica(f"r{i}", ready_at=0.0) for i in range(start)]
    serial = start
    queue: deque[float] = deque()
    run = Run()
    period_waits: list[float] = []
    trailing: deque[tuple[float, float]] = deque()
    """(dequeued at, wait) of the last period: the true p90, looked at every step until it crosses."""
    next_tick = period_s
    t = 0.0
    while t < duration:
        t = round(t + _DT, 6)
        # Poisson arrivals in this step.
        lam = rate(t) * _DT
        n, p, threshold = 0, 1.0, math.exp(-lam)
        while True:
            p *= rng.random()
            if p <= threshold:
                break
            n += 1
        queue.extend([t] * n)
        for r in replicas:
            done = [e for e in r.running if e <= t]
            if done:
                run.served += len(done)
                r.running = [e for e in r.running if e > t]
        ready = sorted((r for r in replicas if r.ready_at <= t), key=lambda r: len(r.running))
        for r in ready:
            while queue and len(r.running) < slots:
                wait = t - queue.popleft()
                r.observe(wait)
                period_waits.append(wait)
                trailing.append((t, wait))
                r.running.append(t + service_s)
        while trailing and trailing[0][0] <= t - period_s:
            trailing.popleft()
        if run.crossed_at is None and t >= watch_from and trailing:
            waits = sorted(w for _, w in trailing)
            if waits[min(len(waits) - 1, int(0.9 * len(waits)))] > _TARGET_S:
                run.crossed_at = t
        if t + 1e-9 >= next_tick:
            next_tick += period_s
            if period_waits:
                waits = sorted(period_waits)
                p90 = waits[min(len(waits) - 1, int(0.9 * len(waits)))]
                run.p90_over_time.append((t, p90))
            period_waits = []
            want = policy(t, replicas, len(queue), float(slots))
            have = len(replicas)
            if want > have:
                for _ in range(want - have):
                    replicas.append(Replica(f"r{serial}", ready_at=t + load_s))
                    serial += 1
            elif want < have:
                # Loading replicas are never removed; the least busy ready ones go, their streams finish.
                for r in sorted(ready, key=lambda r: len(r.running))[: have - want]:
                    run.served += len(r.running)
                    replicas.remove(r)
            if want != have:
                run.decisions.append((t, have, want))
            run.replicas_over_time.append((t, len(replicas)))
    return run


def flaps(decisions: list[tuple[float, int, int]]) -> int:
    """Direction reversals: a scale-down after a scale-up, or the reverse."""
    signs = [1 if to > frm else -1 for _, frm, to in decisions]
    return sum(1 for a, b in itertools.pairwise(signs) if a != b)


def summary(run: Run, step_at: float | None = None) -> dict[str, object]:
    ups = [d for d in run.decisions if d[2] > d[1]]
    downs = [d for d in run.decisions if d[2] < d[1]]
    out: dict[str, object] = {
        "decisions": len(run.decisions),
        "up": len(ups),
        "down": len(downs),
        "flaps": flaps(run.decisions),
        "final_replicas": run.replicas_over_time[-1][1] if run.replicas_over_time else None,
        "max_replicas": max((n for _, n in run.replicas_over_time), default=None),
        "max_period_p90_s": round(max((p for _, p in run.p90_over_time), default=0.0), 3),
    }
    if step_at is not None:
        first_up = next((d[0] for d in ups if d[0] >= step_at), None)
        out["step_at_s"] = step_at
        out["crossed_at_s"] = run.crossed_at
        out["first_up_at_s"] = first_up
        out["reaction_s"] = (
            round(first_up - run.crossed_at, 2)
            if first_up is not None and run.crossed_at is not None
            else None
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1, help="first seed")
    parser.add_argument("--seeds", type=int, default=5, help="runs per scenario: seeds seed … seed+N-1")
    parser.add_argument("--slots", type=int, default=16, help="concurrent sequences per replica")
    parser.add_argument("--service-s", type=float, default=1.0, help="seconds one request runs")
    parser.add_argument("--period", type=float, default=5.0, help="controller period (its default)")
    parser.add_argument("--load-s", type=float, default=20.0, help="seconds a new replica loads")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "controller" / "results")
    args = parser.parse_args()

    capacity = args.slots / args.service_s  # requests per second one replica serves
    cfg = AutoscaleConfig()
    low, high = 1, 8
    common = {
        "slots": args.slots,
        "service_s": args.service_s,
        "period_s": args.period,
        "load_s": args.load_s,
        "seed": args.seed,
    }
    step_at = 300.0
    # Loads in units of what 2 replicas carry at the policy's target (target_ongoing_requests each).
    unit = 2 * cfg.target_ongoing_requests / args.service_s
    scenarios: dict[str, tuple[Callable[[float], float], float, float | None]] = {
        # 75 % of the target, then 250 % (past the 2 replicas' slots: a queue builds).
        "step": (lambda t: unit * (0.75 if t < step_at else 2.5), 900.0, step_at),
        # 90 % of the target for 30 minutes: inside the tolerance band, Poisson noise around it.
        "steady": (lambda _t: unit * 0.9, 1800.0, None),
        # Swinging between 50 % and 125 % of the target every 2 minutes.
        "oscillating": (lambda t: unit * (0.5 if int(t // 120) % 2 == 0 else 1.25), 1800.0, None),
    }
    results: dict[str, object] = {
        "model": {
            **{k: v for k, v in common.items() if k != "seed"},
            "seed": args.seed,
            "replica_capacity_rps": capacity,
            "start_replicas": 2,
            "bounds": [low, high],
            "target_queue_wait_s": _TARGET_S,
        },
        "sarv_defaults": cfg.model_dump(),
        "naive": f"replicas = ceil((waiting + running) / {cfg.target_ongoing_requests:g}) every period",
        "scenarios": {},
    }
    table: dict[str, dict[str, dict[str, object]]] = {}
    for name, (rate, duration, step) in scenarios.items():
        row: dict[str, dict[str, object]] = {}
        for label in ("sarv", "naive"):
            runs = []
            for seed in range(args.seed, args.seed + args.seeds):
                policy: Policy = (
                    SarvPolicy(cfg, low, high)
                    if label == "sarv"
                    else NaivePolicy(cfg.target_ongoing_requests, low, high)
                )
                params = {**common, "seed": seed}
                run = simulate(rate, policy, duration=duration, start=2, watch_from=step or 0.0, **params)  # type: ignore[arg-type]
                one = summary(run, step)
                one["seed"] = seed
                if isinstance(policy, SarvPolicy):
                    one["reasons"] = policy.reasons
                runs.append(one)
            reactions = [float(r["reaction_s"]) for r in runs if isinstance(r.get("reaction_s"), float)]
            agg: dict[str, object] = {
                "decisions_per_run": [r["decisions"] for r in runs],
                "flaps_per_run": [r["flaps"] for r in runs],
            }
            if reactions:
                agg["reaction_s_max"] = max(reactions)
                agg["reaction_s_mean"] = round(sum(reactions) / len(reactions), 2)
            agg["runs"] = runs
            row[label] = agg
        table[name] = row
    results["scenarios"] = table
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "autoscale_reaction.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'scenario':<12} {'policy':<6} {'decisions per run':<24} {'flaps per run':<24} reaction max")
    for name, row in table.items():
        for label, agg in row.items():
            print(
                f"{name:<12} {label:<6} {agg['decisions_per_run']!s:<24} {agg['flaps_per_run']!s:<24} "
                f"{agg.get('reaction_s_max', '-')}"
            )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
