"""Routing policies on 8 simulated replicas with prefix caches: a shared-prefix workload and a control.

Usage: ``.venv/bin/python bench/gateway/routing.py [--seconds 20] [--qps-from 10] [--qps-to 100]``

Groups of users share a long system prompt; arrivals are Poisson with a rate ramping up linearly. Each
policy gets fresh replicas (cold caches) and its own gateway, pinned to one core. The simulator charges
0.25 ms per uncached prompt token and holds at most ``max_num_seqs`` sequences, so cache misses cost
queueing as well as prefill: the llm-d setup, scaled down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from common import (
    PY,
    core,
    free_port,
    make_state,
    one_request,
    pct,
    plot,
    processes,
    seeded,
    sim,
    wait_http,
    write_json,
)

MODEL = "m"
REPLICAS = 8
# Small KV caches (1,024 blocks of 16 tokens): a replica holds a few groups' prefixes, the fleet holds all.
SIM_OPTS = {
    "max_num_seqs": 8,
    "kv_cache_tokens": 16384,
    "max_model_len": 8192,
    "ttft_ms": 30,
    "prefill_ms_per_token": 0.4,
    "itl_ms": 12,
}
WORDS = [a + b + c for a in "bcdfghklmnprst" for b in "aeiou" for c in "dgkmnrst"]
OUTPUT_TOKENS = 16


def text(rng: Any, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def workload(shared: bool, n: int, groups: int, prefix_words: int, seed: int) -> tuple[list[str], list[str]]:
    """(warm-up prompts: one per group, measured prompts)."""
    rng = seeded(seed)
    systems = [text(rng, prefix_words) for _ in range(groups)]
    prompts = []
    for _ in range(n):
        head = rng.choice(systems) if shared else text(rng, prefix_words)
        prompts.append(f"{head}\nUser: {text(rng, 40)}\nAssistant:")
    warm = [f"{s}\nUser: hello\nAssistant:" for s in systems] if shared else []
    return warm, prompts


def arrivals(seconds: float, qps_from: float, qps_to: float, seed: int) -> list[float]:
    """Poisson arrival times with a linearly ramping rate (thinning of a homogeneous process)."""
    rng = seeded(seed)
    peak = max(qps_from, qps_to)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(peak)
        if t >= seconds:
            return out
        rate = qps_from + (qps_to - qps_from) * t / seconds
        if rng.random() < rate / peak:
            out.append(t)


async def drive(url: str, key: str, prompts: list[str], times: list[float]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def one(at: float, prompt: str) -> Any:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            body = json.dumps(
                {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": OUTPUT_TOKENS,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
            return await one_request(session, f"{url}/v1/completions", body, headers, True, timeout=300)

        samples = await asyncio.gather(*(one(t, p) for t, p in zip(times, prompts, strict=False)))
        wall = time.perf_counter() - start
    ok = [s for s in samples if s.ok]
    return {
        "requests": len(samples),
        "ok": len(ok),
        "shed_rate": 1 - len(ok) / len(samples),
        "wall_s": wall,
        "throughput_rps": len(ok) / wall,
        "tokens_per_s": len(ok) * OUTPUT_TOKENS / wall,
        "ttft_p50_ms": pct([s.ttft for s in ok], 50) * 1000,
        "ttft_p90_ms": pct([s.ttft for s in ok], 90) * 1000,
        "ttft_p99_ms": pct([s.ttft for s in ok], 99) * 1000,
        "e2e_p99_ms": pct([s.e2e for s in ok], 99) * 1000,
    }


def run_policy(
    policy: str, warm: list[str], prompts: list[str], times: list[float], tmp: Path
) -> dict[str, Any]:
    work = tmp / policy.replace("+", "-")  # no '+' in a sqlite:/// URL
    work.mkdir(parents=True, exist_ok=True)
    with processes(
        Path(tempfile.gettempdir()) / "sarv-gateway-bench-logs" / work.parent.name / work.name
    ) as procs:
        urls = [sim(procs, f"sim{i}", MODEL, core(0), **SIM_OPTS) for i in range(REPLICAS)]
        env, key = make_state(work, [(f"m-{i}", MODEL, u) for i, u in enumerate(urls)])
        cfg = work / "gateway.yaml"
        cfg.write_text(json.dumps({"routing": {"policy": policy}}))
        port = free_port()
        procs.start(
            "gateway",
            [
                PY,
                "-m",
                "controlplane.cli.main",
                "gateway",
                "--port",
                str(port),
                "--metrics-port",
                "0",
                "--config",
                str(cfg),
            ],
            cpu=core(1),
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/ready")
        time.sleep(1.0)  # one scrape round, so load metrics are fresh from the start
        if warm:
            # Steady state, not cold start: each group has been seen once (same for every policy).
            asyncio.run(drive(url, key, warm, [i * 0.05 for i in range(len(warm))]))
        return asyncio.run(drive(url, key, prompts, times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--qps-from", type=float, default=20.0)
    ap.add_argument("--qps-to", type=float, default=190.0)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--prefix-words", type=int, default=2000, help="shared system prompt, ~1 token per word")
    args = ap.parse_args()
    times = arrivals(args.seconds, args.qps_from, args.qps_to, seed=1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sarv-routing-") as td:
        tmp = Path(td)
        for workload_name, shared in (("shared", True), ("no-sharing", False)):
            warm, prompts = workload(shared, len(times), args.groups, args.prefix_words, seed=2)
            for policy in ("round-robin", "least-load", "prefix+load"):
                res = run_policy(policy, warm, prompts, times, tmp / workload_name)
                row = {"workload": workload_name, "policy": policy, **res}
                rows.append(row)
                print(
                    f"{workload_name:10} {policy:12} ok={row['ok']}/{row['requests']} "
                    f"ttft p50/p90/p99={row['ttft_p50_ms']:.0f}/{row['ttft_p90_ms']:.0f}/"
                    f"{row['ttft_p99_ms']:.0f} ms "
                    f"tok/s={row['tokens_per_s']:.0f} shed={row['shed_rate']:.3f}",
                    flush=True,
                )

    def get(w: str, p: str) -> dict[str, Any]:
        return next(r for r in rows if r["workload"] == w and r["policy"] == p)

    s_pl, s_rr = get("shared", "prefix+load"), get("shared", "round-robin")
    n_pl, n_ll = get("no-sharing", "prefix+load"), get("no-sharing", "least-load")
    checks = {
        "shared_ttft_p99_ratio_vs_rr": s_pl["ttft_p99_ms"] / s_rr["ttft_p99_ms"],
        "shared_throughput_ratio_vs_rr": s_pl["tokens_per_s"] / s_rr["tokens_per_s"],
        "nosharing_throughput_ratio_vs_least_load": n_pl["tokens_per_s"] / n_ll["tokens_per_s"],
        "nosharing_ttft_p99_ratio_vs_least_load": n_pl["ttft_p99_ms"] / n_ll["ttft_p99_ms"],
        "prefix_load_success": s_pl["ok"] / s_pl["requests"],
    }
    targets = {
        "shared_ttft_p99_ratio_vs_rr": "<= 0.2",
        "shared_throughput_ratio_vs_rr": ">= 1.5",
        "nosharing_throughput_ratio_vs_least_load": "within 10 %",
        "prefix_load_success": "1.0",
    }
    for k, v in checks.items():
        print(f"{k:45} {v:.3f}   target {targets.get(k, '')}")
    out = {
        "setup": {**vars(args), "replicas": REPLICAS, "sim": SIM_OPTS, "requests": len(times)},
        "rows": rows,
        "checks": checks,
        "targets": targets,
    }
    path = write_json("routing", out)
    print(f"wrote {path}")
    plot("routing", path)


if __name__ == "__main__":
    main()
