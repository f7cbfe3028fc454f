"""Shared fixtures: real servers on loopback (redis-server, a Redis Cluster) and the 'need' guard.

A missing dependency skips a test with a reason on a developer machine, but fails it under CI
(``CI=true``), where ``scripts/test`` installs everything: a skipped check never passes for a green run.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def need(condition: bool, reason: str) -> None:
    """Skip (developer machine) or fail (CI) when a test's real dependency is missing."""
    if condition:
        return
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"required in CI but missing: {reason}")
    pytest.skip(reason)


def need_binary(name: str) -> str:
    path = shutil.which(name)
    need(path is not None, f"{name} is not installed (scripts/test installs it)")
    assert path is not None
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 15.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


@dataclass(frozen=True)
class RedisServer:
    port: int
    password: str | None
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"


def _start_redis(tmp: Path, *extra: str) -> tuple[int, subprocess.Popen[bytes]]:
    binary = need_binary("redis-server")
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp),
         "--save", "", "--appendonly", "no", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_port(port)
    return port, proc


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real standalone redis-server on a free loopback port, for the whole session."""
    port, proc = _start_redis(tmp_path_factory.mktemp("redis"))
    yield RedisServer(port=port, password=None, proc=proc)
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """URL of the session redis-server, flushed before each test."""
    import redis

    client = redis.Redis(port=redis_server.port)
    client.flushall()
    client.close()
    yield redis_server.url


@dataclass(frozen=True)
class RedisCluster:
    ports: list[int]
    procs: list[subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A real 6-process Redis Cluster (3 masters, 3 replicas) on loopback."""
    cli = need_binary("redis-cli")
    base = tmp_path_factory.mktemp("redis-cluster")
    ports: list[int] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(6):
            port, proc = _start_redis(
                base / str(i), "--cluster-enabled", "yes", "--cluster-config-file",
                str(base / str(i) / "nodes.conf"), "--cluster-node-timeout", "5000",
            )
            ports.append(port)
            procs.append(proc)
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
             "--cluster-replicas", "1", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            info = subprocess.run([cli, "-p", str(ports[0]), "cluster", "info"],
                                  capture_output=True, text=True, check=False).stdout
            if "cluster_state:ok" in info:
                break
            time.sleep(0.2)
        else:
            raise TimeoutError("redis cluster did not reach cluster_state:ok")
        yield RedisCluster(ports=ports, procs=procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
