"""Gateway overhead: one fixed-latency upstream called directly, through Sarv, nginx, LiteLLM and vllm-router.

Usage: ``.venv/bin/python bench/gateway/overhead.py [--profile h100-8b stress] [--duration S]
[--concurrency 50 200] [--peers] [--upstream flat|sim] [--arrivals poisson|closed]``

Each proxy runs pinned to core 1 (``taskset``) in front of the same upstream; the load generator (this
process) and the upstream share core 0. Redis, which Sarv's rate limits use, shares Sarv's core: its cost
is Sarv's. Added latency is measured from the client, as the difference to the direct run within the same
invocation (ratios, not absolute numbers, are what carries across machines). Only requests sent after the
warm-up count. Sarv runs with API-key auth and Redis rate limits on. LiteLLM and vllm-router come from the
bench-only venv (setup_bench_venv.sh).

The upstream (``--upstream``):

- ``flat`` (default): ``flatsse.c``, compiled at the start of the run, a fixed-latency OpenAI-shaped
  server in C (epoll, absolute deadlines) that holds its times to within a millisecond at 200 streams
  using ~0.25 of a core.
- ``sim``: Sarv's engine simulator in fixed-latency mode. At 200 h100-8b streams it runs ~0.75 of a core
  writing ~16,700 events/s, and its event loop falls tens of milliseconds behind now and then: the direct
  run's TTFT p50 moved between 31 and 66 ms across repetitions on this VM. Kept for comparison with
  earlier results; a proxy's added latency of a few milliseconds is not readable through it.

The load (``--arrivals``):

- ``poisson`` (default): ``loadgen.py``, requests at Poisson arrivals (an open loop) with the rate that keeps
  N streams in flight on average (Little's law), the same seeded schedule for every target of a
  repetition; responses parsed in protocol callbacks by httptools (~0.2 of a core at 200 streams).
- ``closed``: N aiohttp clients back to back (``common.closed_loop``; ~0.4 of a core at 200 streams).
  Clients of a closed loop against a fixed-latency upstream fall into lockstep after any pause, so bursts
  grow over a run, differently each run.

Profiles (the upstream's fixed latency):

- ``h100-8b``: the reference simulator profile of an 8B model on an H100: 30 ms to the first token, then
  128 tokens 12 ms apart. 200 streams are ~16,700 SSE events/s through the proxy.
- ``stress``: 20 ms, then 16 tokens 5 ms apart: ~2,000 requests and ~34,000 events/s at 200 streams.

Every row records how busy each core was: a ``client`` core near 1.0 means the harness, not the proxy,
set the latency. With ``--repeat N`` (h100-8b: 5) each cell runs N times, targets in a rotating order, and
each row holds the medians (the single runs under ``runs``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from common import (
    PY,
    ROOT,
    closed_loop,
    core,
    core_busy,
    cpu_seconds,
    cpu_ticks,
    free_port,
    make_state,
    missing,
    plot,
    processes,
    require_binary,
    require_module,
    sim,
    summarize,
    wait_http,
    write_json,
)
from loadgen import open_loop

MODEL = "m1"
_BASE = {"latency_mode": "fixed", "max_num_seqs": 4096, "kv_cache_tokens": 1 << 22, "max_model_len": 4096}
PROFILES: dict[str, dict[str, Any]] = {
    "h100-8b": {
        "sim": {**_BASE, "fixed_ttft_ms": 30, "fixed_itl_ms": 12, "fixed_output_tokens": 128},
        "duration": 10.0,
        "warmup": 2.0,
        "repeat": 5,
    },
    "stress": {
        "sim": {**_BASE, "fixed_ttft_ms": 20, "fixed_itl_ms": 5, "fixed_output_tokens": 16},
        "duration": 6.0,
        "warmup": 1.0,
        "repeat": 1,
    },
}
BENCH_VENV = ROOT / ".venv-bench" / "bin"


def nginx_conf(tmp: Path, port: int, upstream: str) -> Path:
    host_port = upstream.removeprefix("http://")
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/nginx-body;
  proxy_temp_path {tmp}/nginx-proxy;
  fastcgi_temp_path {tmp}/nginx-fcgi;
  uwsgi_temp_path {tmp}/nginx-uwsgi;
  scgi_temp_path {tmp}/nginx-scgi;
  upstream sim {{ server {host_port}; keepalive 512; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://sim;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
""")
    return conf


def flat_upstream(procs: Any, tmp: Path, prof: dict[str, Any], cc: str) -> str:
    """flatsse.c built with ``cc`` into ``tmp`` and started on core 0 with the profile's times; its URL."""
    exe = tmp / "flatsse"
    subprocess.run([cc, "-O2", "-o", str(exe), str(Path(__file__).with_name("flatsse.c"))], check=True)
    port = free_port()
    times = [prof["fixed_ttft_ms"], prof["fixed_itl_ms"], prof["fixed_output_tokens"]]
    procs.start("flatsse", [str(exe), str(port), MODEL, *map(str, times)], cpu=core(0))
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health")
    return url


def check_prerequisites(peers: bool, litellm: bool = True, flat: bool = True) -> dict[str, str]:
    """The programs the run needs (name -> path); stops with one line naming the first one missing."""
    tools = {
        "redis-server": require_binary("redis-server", "apt-get install redis-server"),
        "nginx": require_binary("nginx", "apt-get install nginx", also_in=("/usr/sbin", "/sbin")),
    }
    if flat:
        tools["cc"] = require_binary("cc", "apt-get install gcc (or run with --upstream sim)")
    require_module("psutil", "pip install -e '.[bench]'")
    if peers:
        for tool in ("vllm-router", "litellm") if litellm else ("vllm-router",):
            if not (BENCH_VENV / tool).exists():
                missing(
                    f"{tool} is not in {BENCH_VENV}", "create it with `sh bench/gateway/setup_bench_venv.sh`"
                )
    return tools


# --tenants: every level's limits (far above the load) and prices.
_TEAM = {"rpm": 10_000_000, "tpm": 1_000_000_000, "daily_tokens": 10**12, "monthly_tokens": 10**13}
_GATEWAY_CONFIG = {
    "organisation": {**_TEAM, "max_prompt_tokens": 4096},
    "models": {MODEL: {"prompt_price_per_1k": 0.0005, "completion_price_per_1k": 0.0015}},
    "usage_flush_interval_s": 5.0,
}


def start_targets(
    procs: Any,
    tmp: Path,
    sim_url: str,
    peers: bool,
    tools: dict[str, str],
    tenants: bool = False,
    litellm: bool = True,
) -> dict[str, dict[str, Any]]:
    """Every proxy in front of the sim, pinned to core 1; name -> {url, pid, headers}."""
    targets: dict[str, dict[str, Any]] = {"direct": {"url": sim_url, "pid": None, "headers": {}}}

    # Sarv: Redis state (keys, replicas) and Redis rate limits on, with limits far above the load.
    redis_port = free_port()
    procs.start(
        "redis",
        [
            tools["redis-server"],
            "--port",
            str(redis_port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        cpu=core(1),
    )
    time.sleep(0.5)
    # --tenants: a second Sarv beside the plain one, in the same run: its key in a team, organisation
    # limits and prices (usage accounting is always on), the access log to a file; own Redis db.
    variants = [("sarv", 0, False)] + ([("sarv-tenants", 1, True)] if tenants else [])
    for name, db, on in variants:
        env, key = make_state(
            tmp,
            [("m1-0", MODEL, sim_url)],
            redis_url=f"redis://127.0.0.1:{redis_port}/{db}",
            key_limits={"rpm": 10_000_000, "tpm": 1_000_000_000},
            team=_TEAM if on else None,
        )
        port = free_port()
        argv = [PY, "-m", "controlplane.cli.main", "gateway", "--port", str(port), "--metrics-port", "0"]
        if on:
            config = {**_GATEWAY_CONFIG, "access_log": {"enabled": True, "path": str(tmp / "access.jsonl")}}
            (tmp / "gateway.yaml").write_text(json.dumps(config))
            argv += ["--config", str(tmp / "gateway.yaml")]
        p = procs.start(name, argv, cpu=core(1), env=env)
        wait_http(f"http://127.0.0.1:{port}/health")
        targets[name] = {
            "url": f"http://127.0.0.1:{port}",
            "pid": p.pid,
            "headers": {"Authorization": f"Bearer {key}"},
        }

    port = free_port()
    conf = nginx_conf(tmp, port, sim_url)
    p = procs.start("nginx", [tools["nginx"], "-c", str(conf), "-p", str(tmp)], cpu=core(1))
    wait_http(f"http://127.0.0.1:{port}/health")
    targets["nginx"] = {"url": f"http://127.0.0.1:{port}", "pid": p.pid, "headers": {}}

    if peers:
        port = free_port()
        p = procs.start(
            "vllm-router",
            [
                str(BENCH_VENV / "vllm-router"),
                "--worker-urls",
                sim_url,
                "--port",
                str(port),
                "--worker-startup-check-interval",
                "1",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
            ],
            cpu=core(1),
        )
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
            targets["vllm-router"] = {"url": f"http://127.0.0.1:{port}", "pid": p.pid, "headers": {}}
        except TimeoutError:
            print("vllm-router did not start; see its log")
    if peers and litellm:
        port = free_port()
        cfg = tmp / "litellm.yaml"
        cfg.write_text(
            json.dumps(
                {
                    "model_list": [
                        {
                            "model_name": MODEL,
                            "litellm_params": {
                                "model": f"openai/{MODEL}",
                                "api_base": f"{sim_url}/v1",
                                "api_key": "none",
                            },
                        }
                    ],
                    "general_settings": {"master_key": "sk-bench-1234"},
                    "litellm_settings": {"telemetry": False},
                }
            )
        )
        p = procs.start(
            "litellm",
            [
                str(BENCH_VENV / "litellm"),
                "--config",
                str(cfg),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            cpu=core(1),
            env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"},
        )
        try:
            wait_http(f"http://127.0.0.1:{port}/health/liveliness", timeout=120)
            targets["litellm"] = {
                "url": f"http://127.0.0.1:{port}",
                "pid": p.pid,
                "headers": {"Authorization": "Bearer sk-bench-1234"},
            }
        except TimeoutError:
            print("litellm did not start; see its log")
    return targets


def measure(
    name: str, target: str, t: dict[str, Any], cell: dict[str, Any], rep: int, arrivals: str
) -> dict[str, Any]:
    """One load run against one target: its row (latencies, throughput, CPU, core utilisation)."""
    headers = {"Content-Type": "application/json", **t["headers"]}
    url = f"{t['url']}/v1/completions"
    cpu0 = cpu_seconds(t["pid"]) if t["pid"] else 0.0
    ticks = cpu_ticks()
    t_run = time.perf_counter()
    extra: dict[str, Any] = {}
    if arrivals == "poisson":
        conc = cell["concurrency"]
        res = uvloop.run(
            open_loop(
                url,
                cell["body"],
                headers,
                stream=cell["stream"],
                rate=conc / cell["stagger"],
                duration=cell["duration"],
                warmup=cell["warmup"],
                seed=1000 * rep + conc + (1 if cell["stream"] else 0),
                pool=conc + conc // 2 + 16,
            )
        )
        samples, wall, completed, answered = res.samples, res.window_s, res.completed_in_window, res.completed
        extra = {
            "client_late_p99_ms": res.late_p99_ms,
            "connections_opened_in_run": res.opened_in_run,
            "mean_in_flight": res.mean_in_flight,
        }
    else:
        samples, wall, completed = asyncio.run(
            closed_loop(
                url,
                cell["body"],
                headers,
                stream=cell["stream"],
                concurrency=cell["concurrency"],
                duration=cell["duration"],
                warmup=cell["warmup"],
                stagger=cell["stagger"],
            )
        )
        answered = 0
    busy = core_busy(ticks, cpu_ticks())
    cpu1 = cpu_seconds(t["pid"]) if t["pid"] else 0.0
    elapsed = time.perf_counter() - t_run
    row = {
        "target": target,
        "stream": cell["stream"],
        "concurrency": cell["concurrency"],
        "rep": rep,
        **summarize(samples, wall, completed),
        **extra,
        "core_busy": {"proxy": busy.get(core(1)), "client": busy.get(core(0))},
    }
    rps = row["throughput_rps"]
    if not t["pid"]:
        row["cpu_s_per_1k"] = None
    elif answered:
        # open loop: every answer of the run, warm-up and drain included, against the CPU of the run
        row["cpu_s_per_1k"] = (cpu1 - cpu0) / answered * 1000
    else:
        # closed loop: the proxy's CPU rate over the whole run / the request rate in the window
        row["cpu_s_per_1k"] = (cpu1 - cpu0) / elapsed / rps * 1000 if rps else None
    print(
        f"{name:8} {target:12} stream={cell['stream']!s:5} c={cell['concurrency']:<4} rep={rep} "
        f"ok={row['ok']:<6} rps={rps:8.1f} ttft p50/p99={row['ttft_p50_ms']:7.2f}/"
        f"{row['ttft_p99_ms']:7.2f} e2e p50/p99={row['e2e_p50_ms']:7.2f}/{row['e2e_p99_ms']:7.2f} "
        f"shed={row['shed_rate']:.3f} busy proxy/client={busy.get(core(1), 0):.2f}/"
        f"{busy.get(core(0), 0):.2f} cpu/1k={row['cpu_s_per_1k']}",
        flush=True,
    )
    return row


_ADDED = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per target and cell: the median of each number over the repetitions, and the runs."""
    first = runs[0]
    row: dict[str, Any] = {k: first[k] for k in ("target", "stream", "concurrency")}
    for k, v in first.items():
        if k in row or k == "rep":
            continue
        if isinstance(v, float | int) and not isinstance(v, bool):
            vals = [r[k] for r in runs if r[k] is not None and not math.isnan(r[k])]
            row[k] = statistics.median(vals) if vals else float("nan")
        elif v is None:
            vals = [r[k] for r in runs if r[k] is not None]
            row[k] = statistics.median(vals) if vals else None
    row["statuses"] = first["statuses"]
    row["core_busy"] = {
        c: statistics.median(r["core_busy"][c] or 0.0 for r in runs) for c in ("proxy", "client")
    }
    row["reps"] = len(runs)
    row["runs"] = runs
    return row


def run_profile(name: str, args: argparse.Namespace, tools: dict[str, str]) -> dict[str, Any]:
    prof = PROFILES[name]
    duration = args.duration or prof["duration"]
    repeat = args.repeat or prof["repeat"]
    tokens = prof["sim"]["fixed_output_tokens"]
    # one request's duration: clients start spread over it (see closed_loop)
    stagger = (prof["sim"]["fixed_ttft_ms"] + (tokens - 1) * prof["sim"]["fixed_itl_ms"]) / 1000
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sarv-bench-") as td:
        tmp = Path(td)
        with processes(tmp / "logs") as procs:
            if args.upstream == "flat":
                sim_url = flat_upstream(procs, tmp, prof["sim"], tools["cc"])
            else:
                sim_url = sim(procs, "sim", MODEL, core(0), **prof["sim"])
            targets = start_targets(procs, tmp, sim_url, args.peers, tools, args.tenants, not args.no_litellm)
            names = list(targets)
            for stream in (True, False):
                body = json.dumps(
                    {"model": MODEL, "prompt": "Say something short.", "max_tokens": tokens, "stream": stream}
                ).encode()
                for conc in args.concurrency:
                    cell = {
                        "body": body,
                        "stream": stream,
                        "concurrency": conc,
                        "duration": duration,
                        "warmup": prof["warmup"],
                        "stagger": stagger,
                    }
                    for rep in range(repeat):
                        # a different order each time: no target always runs first, or after LiteLLM
                        order = names[rep % len(names) :] + names[: rep % len(names)]
                        for target in order:
                            runs.append(measure(name, target, targets[target], cell, rep, args.arrivals))
    for run in runs:
        base = next(
            r
            for r in runs
            if r["target"] == "direct"
            and (r["stream"], r["concurrency"], r["rep"]) == (run["stream"], run["concurrency"], run["rep"])
        )
        for m in _ADDED:
            run[f"added_{m}"] = run[m] - base[m]
    cells: dict[tuple[str, bool, int], list[dict[str, Any]]] = {}
    for run in runs:
        cells.setdefault((run["target"], run["stream"], run["concurrency"]), []).append(run)
    rows = [median_row(group) for group in cells.values()]
    out: dict[str, Any] = {
        "profile": name,
        "setup": {
            "sim": prof["sim"],
            "duration_s": duration,
            "warmup_s": prof["warmup"],
            "stagger_s": stagger,
            "repeat": repeat,
            "upstream": args.upstream,
            "arrivals": args.arrivals,
            "cores": {"proxy+redis": core(1), "upstream+client": core(0)},
            "sarv_tenants": args.tenants,
            "sarv_gateway_config": _GATEWAY_CONFIG if args.tenants else {},
        },
        "rows": rows,
    }
    sarv = {(r["stream"], r["concurrency"]): r for r in rows if r["target"] == "sarv"}
    lite = {(r["stream"], r["concurrency"]): r for r in rows if r["target"] == "litellm"}
    out["throughput_vs_litellm"] = {
        f"stream={k[0]},c={k[1]}": sarv[k]["throughput_rps"] / lite[k]["throughput_rps"]
        for k in lite
        if k in sarv and lite[k]["throughput_rps"]
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--profile", nargs="+", choices=sorted(PROFILES), default=["h100-8b", "stress"])
    ap.add_argument("--duration", type=float, default=None, help="seconds per cell (default: per profile)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[50, 200])
    ap.add_argument(
        "--repeat", type=int, default=None, help="runs per cell, medians reported (default: per profile)"
    )
    ap.add_argument("--peers", action="store_true", help="also LiteLLM and vllm-router (bench venv)")
    ap.add_argument("--no-litellm", action="store_true", help="with --peers: vllm-router only")
    ap.add_argument(
        "--tenants",
        action="store_true",
        help="also a second Sarv with its key in a team, organisation limits, prices and the access log",
    )
    ap.add_argument(
        "--upstream",
        choices=["flat", "sim"],
        default="flat",
        help="fixed-latency upstream: flatsse.c (default) or Sarv's simulator",
    )
    ap.add_argument(
        "--arrivals",
        choices=["poisson", "closed"],
        default="poisson",
        help="load: Poisson arrivals on a shared schedule (default) or a closed loop of N clients",
    )
    ap.add_argument("--output", default=None, help="results name (default: overhead-<profile>)")
    args = ap.parse_args()
    tools = check_prerequisites(args.peers, not args.no_litellm, args.upstream == "flat")
    # The load generator shares core 0 with the simulator; the proxies (and Redis) have core 1.
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(core(0))})
    for name in args.profile:
        path = write_json(args.output or f"overhead-{name}", run_profile(name, args, tools))
        print(f"wrote {path}")
        plot("overhead", path)
        time.sleep(1)


if __name__ == "__main__":
    main()
