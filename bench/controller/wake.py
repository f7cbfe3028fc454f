"""Wake-to-first-token of a sleeping replica against a cold start, with the simulator (same run, ratio).

A replica scaled to zero comes back either cold (a new engine process loads its weights: ``slow_start_s``
models it) or from vLLM's sleep mode (level 1: weights back from host memory, ``wake_s``; level 2: reloaded
from the model cache, ``wake_level2_s``). The times the simulator sleeps are the model's inputs, taken from
vLLM's sleep-mode documentation and blog (level-1 wake of an 8B model well under a second; a cold start of
the same model tens of seconds); what this measures is each path end to end as a client sees it: process
start or ``/wake_up``, readiness, and the first streamed token.

    .venv/bin/python bench/controller/wake.py [--trials 3] [--cold-s 20] [--wake-s 0.5] [--wake-level2-s 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).with_name("results")
POLL_S = 0.02
DEADLINE_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(port: int, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "controlplane.simulator", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "m", "--latency-mode", "fixed", "--fixed-ttft-ms", "20", *args]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _first_token(url: str, t0: float) -> float:
    """Seconds from ``t0`` to the first streamed token: readiness polled first, as a gateway would."""
    deadline = t0 + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(POLL_S)
    body = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=DEADLINE_S) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - t0
    raise RuntimeError("the stream ended without a token")


def cold(cold_s: float) -> float:
    port = _free_port()
    t0 = time.monotonic()
    proc = _start(port, "--slow-start-s", str(cold_s))
    try:
        return _first_token(f"http://127.0.0.1:{port}", t0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def wake(url: str, level: int) -> float:
    httpx.post(f"{url}/sleep", params={"level": level}, timeout=60).raise_for_status()
    t0 = time.monotonic()
    httpx.post(f"{url}/wake_up", timeout=DEADLINE_S).raise_for_status()
    return _first_token(url, t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--cold-s", type=float, default=20.0, help="modelled cold start (weights load)")
    parser.add_argument("--wake-s", type=float, default=0.5, help="modelled level-1 wake-up")
    parser.add_argument("--wake-level2-s", type=float, default=5.0, help="modelled level-2 wake-up")
    parser.add_argument("--out", type=Path, default=RESULTS / "wake.json")
    args = parser.parse_args(argv)
    if not 1 <= args.trials <= 20:
        parser.error("--trials must be between 1 and 20")

    port = _free_port()
    sleeper = _start(port, "--enable-sleep-mode", "--wake-s", str(args.wake_s),
                     "--wake-level2-s", str(args.wake_level2_s))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _first_token(url, time.monotonic())  # started and warm
        runs: dict[str, list[float]] = {"cold": [], "wake_level1": [], "wake_level2": []}
        for i in range(args.trials):
            print(f"trial {i + 1}/{args.trials}: cold start …", file=sys.stderr, flush=True)
            runs["cold"].append(cold(args.cold_s))
            runs["wake_level1"].append(wake(url, 1))
            runs["wake_level2"].append(wake(url, 2))
    finally:
        sleeper.terminate()
        sleeper.wait(timeout=30)
    p50 = {k: statistics.median(v) for k, v in runs.items()}
    modelled = {"cold": args.cold_s, "wake_level1": args.wake_s, "wake_level2": args.wake_level2_s}
    result = {
        "trials": args.trials,
        "modelled_s": modelled,
        "to_first_token_p50_s": p50,
        "overhead_beyond_model_p50_s": {k: p50[k] - modelled[k] for k in p50},
        "cold_over_wake_level1": p50["cold"] / p50["wake_level1"],
        "cold_over_wake_level2": p50["cold"] / p50["wake_level2"],
        "runs_s": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for k in runs:
        print(f"{k:12s} first token after {p50[k]:7.3f} s (modelled {modelled[k]:.3f} s)")
    print(f"cold / wake level 1 = {result['cold_over_wake_level1']:.1f}×; written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
