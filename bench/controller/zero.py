"""Scale to zero as a client sees it: a request held by the gateway while the controller wakes the
deployment, from sleep mode or by a cold start, with the simulator (same run, ratio).

Each path is the real stack in processes: ``llmctl deploy`` of a ``sim`` deployment with
``--scale-to-zero --idle-timeout 2``, ``llmctl controller run``, ``llmctl gateway``. Once the deployment
is at zero a streamed completion goes to the gateway; the time to its first token is the hold (the wake
request, the controller's reaction, ``/wake_up`` or the process start and load, discovery) plus the
answer. The simulator's modelled times are the inputs (``--wake-s`` for a level-1 wake, ``--cold-s`` for
a cold start's weights load, as bench/controller/wake.py); the bench measures what Sarv adds to them.

    .venv/bin/python bench/controller/zero.py [--trials 2] [--cold-s 10] [--wake-s 0.5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).with_name("results")
MODEL = "sarv-tiny"
DEADLINE_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SARV_")}
    env.update(
        SARV_HOME=str(home),
        SARV_STATE_URL=f"sqlite:///{home / 'state.db'}",
        XDG_CONFIG_HOME=str(home / "xdg"),
        PYTHONPATH=str(ROOT),
    )
    return env


def _llmctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "controlplane.cli.main", *args]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=DEADLINE_S, check=False)
    if proc.returncode:
        raise RuntimeError(f"llmctl {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _spawn(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "controlplane.cli.main", *args]
    with log.open("w") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


def _until(check: object, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not happen within {DEADLINE_S:.0f}s")


def _first_token(url: str, key: str) -> float:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
    t0 = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=DEADLINE_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - t0
    raise RuntimeError("the stream ended without a token")


def run_path(name: str, trials: int, engine_args: list[str]) -> list[float]:
    """``trials`` wakes of one deployment through the gateway: each once it is at zero again."""
    from controlplane.gateway.auth import hash_key, new_key
    from controlplane.state import open_store
    from controlplane.state.base import ApiKeyRecord

    with tempfile.TemporaryDirectory(prefix=f"sarv-zero-{name}-") as tmp:
        home = Path(tmp)
        env = _env(home)
        args = [a for arg in engine_args for a in ("--engine-arg", arg)]
        _llmctl(env, "deploy", MODEL, "--engine", "sim", "--scale-to-zero", "--idle-timeout", "2", *args)
        store = open_store(env["SARV_STATE_URL"])
        key = new_key()
        store.put_api_key(ApiKeyRecord(name="bench", key_hash=hash_key(key), prefix=key[:12]))
        (home / "controller.yaml").write_text("period_s: 1\n")
        (home / "gateway.yaml").write_text(
            "routing:\n  discovery_interval_s: 0.2\nhold:\n  hold_timeout_s: 300\n"
        )
        port = _free_port()
        controller = ["controller", "run", "-c", str(home / "controller.yaml"), "--metrics-port", "0"]
        gateway = ["gateway", "--port", str(port), "-c", str(home / "gateway.yaml")]
        procs = [
            _spawn(env, home / "controller.log", *controller),
            _spawn(env, home / "gateway.log", *gateway, "--metrics-port", str(_free_port())),
        ]
        url = f"http://127.0.0.1:{port}"
        out: list[float] = []
        try:
            for i in range(trials):
                zeroed = len([e for e in store.list_events(MODEL) if e.reason == "ScaledToZero"])

                def again(before: int = zeroed) -> bool:
                    dep = store.get_deployment(MODEL)
                    n = len([e for e in store.list_events(MODEL) if e.reason == "ScaledToZero"])
                    return dep is not None and dep.zero is not None and n > before

                _until(again, f"{name}: scale to zero")
                print(f"{name} trial {i + 1}/{trials}: at zero, request …", file=sys.stderr, flush=True)
                out.append(_first_token(url, key))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(timeout=30)
            _llmctl(env, "undeploy", MODEL, "--yes")
            store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--cold-s", type=float, default=10.0, help="modelled cold start (weights load)")
    parser.add_argument("--wake-s", type=float, default=0.5, help="modelled level-1 wake-up")
    parser.add_argument("--out", type=Path, default=RESULTS / "zero.json")
    args = parser.parse_args(argv)
    if not 1 <= args.trials <= 10:
        parser.error("--trials must be between 1 and 10")
    runs = {
        "sleep_wake": run_path("sleep", args.trials, ["enable_sleep_mode=true", f"wake_s={args.wake_s}"]),
        "cold_start": run_path("cold", args.trials, [f"slow_start_s={args.cold_s}"]),
    }
    p50 = {k: statistics.median(v) for k, v in runs.items()}
    modelled = {"sleep_wake": args.wake_s, "cold_start": args.cold_s}
    result = {
        "trials": args.trials,
        "modelled_s": modelled,
        "held_to_first_token_p50_s": p50,
        "overhead_beyond_model_p50_s": {k: p50[k] - modelled[k] for k in p50},
        "cold_over_sleep_wake": p50["cold_start"] / p50["sleep_wake"],
        "runs_s": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for k in runs:
        print(f"{k:11s} held request's first token after {p50[k]:7.3f} s (modelled {modelled[k]:.3f} s)")
    print(f"cold start / sleep wake = {result['cold_over_sleep_wake']:.1f}×; written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
