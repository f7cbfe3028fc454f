"""``llmctl controller run`` as real processes: --once, the lease of two controllers, SIGTERM, /metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from fixtures.common import REPO, free_port, wait_port
from fixtures.sim import SimFactory

from controlplane.controller.lease import FileLease
from controlplane.spec import EngineKind, ReplicaRecord, ReplicaState
from controlplane.state import open_store


def _replica(endpoint: str, index: int = 0) -> ReplicaRecord:
    return ReplicaRecord(
        id=f"m-{index}",
        deployment="m",
        index=index,
        model="m",
        engine=EngineKind.SIM,
        node="localhost",
        endpoint=endpoint,
        state=ReplicaState.READY,
    )


@dataclass
class Env:
    tmp: Path
    state_url: str

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SARV_")}
        env.update(
            SARV_HOME=str(self.tmp / "home"),
            SARV_STATE_URL=self.state_url,
            XDG_CONFIG_HOME=str(self.tmp / "config"),  # no ~/.config/sarv/config.yaml of the developer
            COLUMNS="120",
        )
        return env

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "controlplane.cli.main", "controller", "run", *args]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            check=False,
            env=self.environ(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.fixture
def sqlite_env(tmp_path: Path) -> Env:
    return Env(tmp_path, f"sqlite:///{tmp_path / 'state.db'}")


def test_once_probes_and_writes_targets(sim_server: SimFactory, sqlite_env: Env) -> None:
    sim = sim_server(served_model_name="m")
    store = open_store(sqlite_env.state_url)
    store.put_replica(_replica(sim.url))
    store.put_replica(_replica(f"http://127.0.0.1:{free_port()}", 1))
    store.close()
    targets = sqlite_env.tmp / "sd" / "replicas.json"
    out = sqlite_env.run("--once", "--targets-file", str(targets), "--failure-threshold", "1")
    assert out.returncode == 0, out.stderr
    assert "probed 2 replica(s)" in out.stdout
    assert "changed m-1" in out.stdout
    assert [g["labels"]["replica"] for g in json.loads(targets.read_text())] == ["m-0"]
    store = open_store(sqlite_env.state_url)
    got = store.get_replica("m-1")
    store.close()
    assert got is not None and got.state is ReplicaState.UNHEALTHY


def test_targets_file_from_the_environment(sim_server: SimFactory, sqlite_env: Env) -> None:
    sim = sim_server(served_model_name="m")
    store = open_store(sqlite_env.state_url)
    store.put_replica(_replica(sim.url))
    store.close()
    targets = sqlite_env.tmp / "env-targets.json"
    env = sqlite_env.environ() | {"SARV_PROMETHEUS_TARGETS": str(targets)}
    out = subprocess.run(
        sqlite_env.argv("--once"), check=False, env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert targets.is_file()


def test_once_refuses_to_act_without_the_lease(sqlite_env: Env) -> None:
    lock = FileLease(sqlite_env.tmp / "state.db.controller.lock", holder="someone-else")
    assert lock.acquire()
    try:
        out = sqlite_env.run("--once")
    finally:
        lock.release()
    assert out.returncode == 1
    assert "error: another controller holds the lease; nothing done" in out.stderr
    assert "not the leader" in out.stdout


def test_bad_config_is_one_line_and_exit_2(sqlite_env: Env) -> None:
    cfg = sqlite_env.tmp / "controller.yaml"
    cfg.write_text("failure_threshold: 0\n")
    out = sqlite_env.run("--once", "--config", str(cfg))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: invalid controller config: failure_threshold: Input should be greater than or equal to 1"
    ]


@dataclass
class Controller:
    proc: subprocess.Popen[str]
    metrics_port: int

    def metric(self, name: str) -> float | None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2, trust_env=False).text
        except httpx.HTTPError:
            return None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and not sample.labels:
                    return sample.value
        return None


def _wait(predicate: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout}s")
        time.sleep(0.1)


@pytest.fixture
def controllers(tmp_path: Path, redis_url: str) -> Iterator[tuple[Env, list[Controller]]]:
    env = Env(tmp_path, redis_url)
    started: list[Controller] = []
    yield env, started
    for c in started:
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait(timeout=10)
        for stream in (c.proc.stdout, c.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.redis
@pytest.mark.slow
def test_two_controller_processes_one_leads_standby_takes_over_and_sigterm_is_clean(
    sim_server: SimFactory, controllers: tuple[Env, list[Controller]]
) -> None:
    env, started = controllers
    sim = sim_server(served_model_name="m")
    store = open_store(env.state_url)
    store.put_replica(_replica(sim.url))
    store.close()
    for _ in range(2):
        port = free_port()
        proc = subprocess.Popen(
            env.argv("--period", "0.2", "--lease-ttl", "2", "--metrics-port", str(port)),
            env=env.environ(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(Controller(proc, port))
    for c in started:
        wait_port(c.metrics_port, timeout=60)
    _wait(
        lambda: sorted(c.metric("sarv_controller_leader") or 0 for c in started) == [0, 1],
        "no single leader",
    )
    leader = next(c for c in started if c.metric("sarv_controller_leader") == 1)
    standby = next(c for c in started if c is not leader)
    # It runs, it just does not act (its first pass may still be under way when the leader is known).
    _wait(lambda: (standby.metric("sarv_controller_passes_total") or 0) > 0, "the standby never ran a pass")
    assert leader.metric("sarv_controller_loop_seconds") is not None

    leader.proc.send_signal(signal.SIGKILL)  # a crash: the lease is not released, it must expire
    leader.proc.wait(timeout=10)
    _wait(lambda: standby.metric("sarv_controller_leader") == 1, "the standby never took over")

    standby.proc.send_signal(signal.SIGTERM)
    assert standby.proc.wait(timeout=30) == 0
    stderr = standby.proc.stderr.read() if standby.proc.stderr else ""
    assert "controller stopped" in stderr
    assert "Traceback" not in stderr
    raw = redis.Redis.from_url(env.state_url, decode_responses=True)
    try:
        assert raw.get("{sarv:}controller-lease") is None  # released on the way out
    finally:
        raw.close()
