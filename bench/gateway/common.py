"""Shared pieces of the gateway benchmarks: pinned processes, a state store with a key, a load generator."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
PY = sys.executable
CORES = os.cpu_count() or 1


def missing(what: str, how: str) -> NoReturn:
    """Stop with one line on stderr naming a missing prerequisite and how to get it (exit status 2)."""
    print(f"error: {what}; {how}", file=sys.stderr)
    raise SystemExit(2)


def require_binary(name: str, install: str, *, also_in: tuple[str, ...] = ()) -> str:
    """The path of program ``name`` from PATH (then ``also_in``), or stop with how to ``install`` it."""
    found = shutil.which(name) or shutil.which(name, path=os.pathsep.join(also_in))
    if found is None:
        missing(f"{name} is not installed (not on PATH)", f"install it with `{install}`")
    return found


def require_module(name: str, install: str) -> None:
    """Stop unless Python module ``name`` imports, saying how to ``install`` it."""
    try:
        __import__(name)
    except ImportError:
        missing(f"Python module {name} is not installed in {sys.prefix}", f"install it with `{install}`")


def core(i: int) -> str:
    """CPU list for taskset: core ``i`` modulo the machine's cores."""
    return str(i % CORES)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not answering after {timeout}s")


@dataclass
class Procs:
    """Processes started by a benchmark, stopped (group and all) on exit."""

    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        cpu: str | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        if cpu is not None and shutil.which("taskset"):
            argv = ["taskset", "-c", cpu, *argv]
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd or ROOT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)

    def close(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)


@contextlib.contextmanager
def processes(logs: Path) -> Iterator[Procs]:
    logs.mkdir(parents=True, exist_ok=True)
    p = Procs(logs)
    try:
        yield p
    finally:
        p.close()


def sim(procs: Procs, name: str, model: str, cpu: str, **opts: Any) -> str:
    port = free_port()
    args = [
        PY,
        "-m",
        "controlplane.simulator",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        model,
    ]
    for k, v in opts.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    procs.start(name, args, cpu=cpu)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health")
    return url


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children (nginx workers), from /proc."""
    import psutil

    try:
        p = psutil.Process(pid)
        total = sum(p.cpu_times()[:2])
        for c in p.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += sum(c.cpu_times()[:2])
        return float(total)
    except psutil.Error:
        return 0.0


@dataclass
class Sample:
    ok: bool
    status: int
    ttft: float
    e2e: float
    chunks: int = 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    stream: bool,
    timeout: float = 120.0,
) -> Sample:
    t0 = time.perf_counter()
    try:
        async with session.post(
            url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            ttft = 0.0
            chunks = 0
            if stream and resp.status == 200:
                async for _ in resp.content.iter_any():
                    if not chunks:
                        ttft = time.perf_counter() - t0
                    chunks += 1
            else:
                await resp.read()
                ttft = time.perf_counter() - t0
            return Sample(resp.status == 200, resp.status, ttft, time.perf_counter() - t0, chunks)
    except (aiohttp.ClientError, TimeoutError):
        return Sample(False, 0, 0.0, time.perf_counter() - t0)


async def closed_loop(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    stream: bool,
    concurrency: int,
    duration: float,
    warmup: float = 1.0,
    stagger: float = 0.0,
) -> tuple[list[Sample], float, int]:
    """``concurrency`` clients back to back for ``duration`` s after ``warmup``.

    Client ``i`` starts ``i / concurrency × stagger`` s late. Against a fixed-latency backend, clients that
    all start at once stay in lockstep: every request arrives in a burst with all the others, and the
    latency measured is that of the burst's last one. Staggered over one request's duration they arrive
    spread out, as independent users do. ``warmup`` should exceed ``stagger``.

    Returns the samples of requests sent in the window, its length, and the answers completed in it.
    """
    connector = aiohttp.TCPConnector(limit=concurrency + 8, force_close=False)
    samples: list[Sample] = []
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        start = time.perf_counter()
        t_measure = start + warmup
        stop = t_measure + duration

        done_in_window = 0

        async def worker(i: int) -> None:
            nonlocal done_in_window
            await asyncio.sleep(i / concurrency * stagger)
            while time.perf_counter() < stop:
                began = time.perf_counter()
                s = await one_request(session, url, body, headers, stream)
                ended = time.perf_counter()
                # Latencies: only requests sent after the warm-up (the first ones also pay for new
                # connections and cold caches, and a long stream started then would end inside the window).
                if began >= t_measure:
                    samples.append(s)
                # Throughput: answers completed inside the window, whenever they were sent.
                if s.ok and t_measure <= ended <= stop:
                    done_in_window += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return samples, duration, done_in_window


def cpu_ticks() -> dict[str, tuple[int, int]]:
    """Per core: (busy, total) jiffies from /proc/stat, for utilisation over an interval."""
    out: dict[str, tuple[int, int]] = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                v = [int(x) for x in fields]
                out[name.removeprefix("cpu")] = (sum(v) - v[3] - v[4], sum(v))  # minus idle and iowait
    return out


def core_busy(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Busy fraction of each core between two ``cpu_ticks()`` readings."""
    return {
        c: (after[c][0] - before[c][0]) / max(1, after[c][1] - before[c][1]) for c in after if c in before
    }


def summarize(samples: list[Sample], wall: float, completed: int | None = None) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    return {
        "requests": len(samples),
        "ok": len(ok),
        "shed_rate": (len(samples) - len(ok)) / len(samples) if samples else 0.0,
        "throughput_rps": (len(ok) if completed is None else completed) / wall if wall else 0.0,
        "ttft_p50_ms": pct([s.ttft for s in ok], 50) * 1000,
        "ttft_p99_ms": pct([s.ttft for s in ok], 99) * 1000,
        "e2e_p50_ms": pct([s.e2e for s in ok], 50) * 1000,
        "e2e_p99_ms": pct([s.e2e for s in ok], 99) * 1000,
        "statuses": {
            str(k): sum(1 for s in samples if s.status == k) for k in sorted({s.status for s in samples})
        },
    }


def seeded(seed: int) -> random.Random:
    return random.Random(seed)


def write_json(name: str, data: Any) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def plot(kind: str, json_path: Path) -> None:
    """Render the PNG with matplotlib from the bench venv (kept out of the main venv)."""
    py = ROOT / ".venv-bench" / "bin" / "python"
    if not py.exists():
        print(f"(no {py}: skipping the plot; run bench/gateway/setup_bench_venv.sh)")
        return
    subprocess.run([str(py), str(Path(__file__).with_name("plot.py")), kind, str(json_path)], check=False)


def make_state(
    tmp: Path,
    replicas: list[tuple[str, str, str]],
    *,
    redis_url: str | None = None,
    key_limits: dict[str, int] | None = None,
    team: dict[str, int] | None = None,
) -> tuple[dict[str, str], str]:
    """A state store with ``(id, model, url)`` READY replicas and one API key (in a team ``bench`` with
    these limits, when ``team`` is given); returns (env, key)."""
    from controlplane.gateway.auth import hash_key, new_key
    from controlplane.settings import Settings
    from controlplane.spec import EngineKind, ReplicaRecord, ReplicaState
    from controlplane.state import open_store
    from controlplane.state.base import ApiKeyRecord, TeamRecord

    url = redis_url or f"sqlite:///{tmp / 'state.db'}"
    settings = Settings(home=tmp, state_url=url)
    store = open_store(url, settings)
    for i, (rid, model, endpoint) in enumerate(replicas):
        store.put_replica(
            ReplicaRecord(
                id=rid,
                deployment=model,
                index=i,
                model=model,
                engine=EngineKind.SIM,
                node="localhost",
                endpoint=endpoint,
                state=ReplicaState.READY,
            )
        )
    if team is not None:
        store.put_team(TeamRecord(name="bench", created_at=time.time(), **team))
    key = new_key()
    store.put_api_key(
        ApiKeyRecord(
            name="bench",
            key_hash=hash_key(key),
            prefix=key[:12],
            created_at=time.time(),
            team=None if team is None else "bench",
            **(key_limits or {}),
        )
    )
    store.close()
    env = {"SARV_HOME": str(tmp), "SARV_STATE_URL": url, "SARV_CONFIG": str(tmp / "none.yaml")}
    (tmp / "none.yaml").write_text("{}\n")
    return env, key
