"""Gateway overhead: one fixed-latency sim called directly, through Sarv, nginx, LiteLLM and vllm-router.

Usage: ``.venv/bin/python bench/gateway/overhead.py [--duration 6] [--concurrency 50 200] [--peers]``

Each proxy runs pinned to its own core (``taskset``) in front of the same simulator (fixed 20 ms to the
first token, 16 tokens 5 ms apart); the load generator and the simulator share the other core. Added
latency is measured from the client, as the difference to the direct run within the same invocation
(ratios, not absolute numbers, are what carries across machines). Sarv runs with API-key auth and Redis
rate limits on. LiteLLM and vllm-router come from the bench-only venv (setup_bench_venv.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    PY,
    ROOT,
    closed_loop,
    core,
    cpu_seconds,
    free_port,
    make_state,
    plot,
    processes,
    sim,
    summarize,
    wait_http,
    write_json,
)

MODEL = "m1"
SIM_OPTS = {
    "latency_mode": "fixed",
    "fixed_ttft_ms": 20,
    "fixed_itl_ms": 5,
    "fixed_output_tokens": 16,
    "max_num_seqs": 4096,
    "kv_cache_tokens": 1 << 22,
    "max_model_len": 4096,
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


def start_targets(procs: Any, tmp: Path, sim_url: str, peers: bool) -> dict[str, dict[str, Any]]:
    """Every proxy in front of the sim, pinned to core 1; name -> {url, pid, headers}."""
    targets: dict[str, dict[str, Any]] = {"direct": {"url": sim_url, "pid": None, "headers": {}}}

    # Sarv: Redis state (keys, replicas) and Redis rate limits on, with limits far above the load.
    redis_port = free_port()
    procs.start(
        "redis",
        [
            "redis-server",
            "--port",
            str(redis_port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        cpu=core(0),
    )
    time.sleep(0.5)
    env, key = make_state(
        tmp,
        [("m1-0", MODEL, sim_url)],
        redis_url=f"redis://127.0.0.1:{redis_port}/0",
        key_limits={"rpm": 10_000_000, "tpm": 1_000_000_000},
    )
    port = free_port()
    p = procs.start(
        "sarv", [PY, "-m", "controlplane.cli.main", "gateway", "--port", str(port)], cpu=core(1), env=env
    )
    wait_http(f"http://127.0.0.1:{port}/health")
    targets["sarv"] = {
        "url": f"http://127.0.0.1:{port}",
        "pid": p.pid,
        "headers": {"Authorization": f"Bearer {key}"},
    }

    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if Path(nginx).exists():
        port = free_port()
        conf = nginx_conf(tmp, port, sim_url)
        p = procs.start("nginx", [nginx, "-c", str(conf), "-p", str(tmp)], cpu=core(1))
        wait_http(f"http://127.0.0.1:{port}/health")
        targets["nginx"] = {"url": f"http://127.0.0.1:{port}", "pid": p.pid, "headers": {}}

    if peers and (BENCH_VENV / "vllm-router").exists():
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
    if peers and (BENCH_VENV / "litellm").exists():
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[50, 200])
    ap.add_argument("--peers", action="store_true", help="also LiteLLM and vllm-router (bench venv)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sarv-bench-") as td:
        tmp = Path(td)
        with processes(tmp / "logs") as procs:
            sim_url = sim(procs, "sim", MODEL, core(0), **SIM_OPTS)
            targets = start_targets(procs, tmp, sim_url, args.peers)
            rows: list[dict[str, Any]] = []
            for stream in (True, False):
                body = json.dumps(
                    {"model": MODEL, "prompt": "Say something short.", "max_tokens": 16, "stream": stream}
                ).encode()
                for conc in args.concurrency:
                    for name, t in targets.items():
                        headers = {"Content-Type": "application/json", **t["headers"]}
                        cpu0 = cpu_seconds(t["pid"]) if t["pid"] else 0.0
                        samples, wall = asyncio.run(
                            closed_loop(
                                f"{t['url']}/v1/completions",
                                body,
                                headers,
                                stream=stream,
                                concurrency=conc,
                                duration=args.duration,
                            )
                        )
                        cpu1 = cpu_seconds(t["pid"]) if t["pid"] else 0.0
                        row = {
                            "target": name,
                            "stream": stream,
                            "concurrency": conc,
                            **summarize(samples, wall),
                        }
                        row["cpu_s_per_1k"] = (cpu1 - cpu0) / max(1, row["ok"]) * 1000 if t["pid"] else None
                        rows.append(row)
                        print(
                            f"{name:12} stream={stream!s:5} c={conc:<4} ok={row['ok']:<6} "
                            f"rps={row['throughput_rps']:8.1f} ttft p50/p99={row['ttft_p50_ms']:7.2f}/"
                            f"{row['ttft_p99_ms']:7.2f} e2e p50/p99={row['e2e_p50_ms']:7.2f}/"
                            f"{row['e2e_p99_ms']:7.2f} shed={row['shed_rate']:.3f} "
                            f"cpu/1k={row['cpu_s_per_1k']}",
                            flush=True,
                        )
    for row in rows:
        base = next(
            r
            for r in rows
            if r["target"] == "direct"
            and r["stream"] == row["stream"]
            and r["concurrency"] == row["concurrency"]
        )
        for m in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"):
            row[f"added_{m}"] = row[m] - base[m]
    out = {
        "setup": {
            "sim": SIM_OPTS,
            "duration_s": args.duration,
            "cores": {"proxy": core(1), "sim+client": core(0)},
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
    path = write_json("overhead", out)
    print(f"wrote {path}")
    plot("overhead", path)


if __name__ == "__main__":
    main()
