"""file_sd target files: pure rendering, atomic writes, and a real Prometheus scraping what was written."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
from fixtures.common import http_server

from controlplane.errors import StateError
from controlplane.observability import replica_target_groups, write_file_sd, write_replica_targets
from controlplane.spec import EngineKind, ProbePaths, ReplicaRecord, ReplicaState


def _replica(index: int, endpoint: str | None, state: ReplicaState = ReplicaState.READY) -> ReplicaRecord:
    return ReplicaRecord(
        id=f"llama-{index}",
        deployment="llama",
        index=index,
        model="llama-3-8b",
        engine=EngineKind.SIM,
        node="gpu-a1",
        endpoint=endpoint,
        state=state,
    )


def test_groups_only_for_listening_replicas_sorted_and_labelled() -> None:
    replicas = [
        _replica(2, "http://10.0.0.5:8102"),
        _replica(0, "https://gpu-a1.example:8100/v1"),
        _replica(1, None, ReplicaState.PENDING),
        _replica(3, "http://10.0.0.5:8103", ReplicaState.FAILED),  # crashed: kept, so its up == 0 alerts
        _replica(4, "http://[fd00::5]:8104", ReplicaState.STARTING),
        _replica(5, "http://10.0.0.5:8105", ReplicaState.DRAINING),
    ]
    groups = replica_target_groups(replicas)
    assert [g.targets for g in groups] == [
        ["gpu-a1.example:8100"],
        ["10.0.0.5:8102"],
        ["10.0.0.5:8103"],
        ["[fd00::5]:8104"],
    ]
    assert groups[0].labels == {
        "deployment": "llama",
        "replica": "llama-0",
        "model": "llama-3-8b",
        "node": "gpu-a1",
        "engine_kind": "sim",
        "__scheme__": "https",
    }
    assert "__scheme__" not in groups[1].labels
    # vLLM's own series labels must not be shadowed by target labels.
    assert not {"model_name", "engine"} & set(groups[1].labels)


def test_an_engine_metrics_path_becomes_the_scrape_path() -> None:
    default, custom = _replica(0, "http://10.0.0.5:8100"), _replica(1, "http://10.0.0.5:8101")
    custom.probes = ProbePaths(metrics="/engine/metrics")
    groups = replica_target_groups([default, custom])
    assert "__metrics_path__" not in groups[0].labels  # Prometheus's default is the engine's path
    assert groups[1].labels["__metrics_path__"] == "/engine/metrics"


def test_bad_endpoint_is_a_state_error() -> None:
    with pytest.raises(StateError, match="not an http"):
        replica_target_groups([_replica(0, "unix:///run/vllm.sock")])


def test_write_is_atomic_stable_and_skips_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "targets" / "replicas.json"
    replicas = [_replica(0, "http://127.0.0.1:8100")]
    assert write_replica_targets(path, replicas) is True
    first = path.read_text()
    assert json.loads(first) == [
        {
            "targets": ["127.0.0.1:8100"],
            "labels": {
                "deployment": "llama",
                "engine_kind": "sim",
                "model": "llama-3-8b",
                "node": "gpu-a1",
                "replica": "llama-0",
            },
        }
    ]
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)
    mtime = path.stat().st_mtime_ns
    assert write_replica_targets(path, replicas) is False
    assert path.stat().st_mtime_ns == mtime
    assert write_file_sd(path, []) is True
    assert json.loads(path.read_text()) == []
    assert sorted(os.listdir(path.parent)) == ["replicas.json"]  # no temporary files left behind


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"# TYPE sarv_test_up gauge\nsarv_test_up 1\n"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        return


@pytest.fixture
def metrics_server() -> Iterator[int]:
    with http_server(_Metrics) as port:
        yield port


def _active_targets(port: int) -> list[dict[str, Any]]:
    resp = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", params={"state": "active"}, timeout=5)
    resp.raise_for_status()
    return list(resp.json()["data"]["activeTargets"])


def _wait_for(port: int, predicate: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        seen = _active_targets(port)
        if predicate(seen):
            return seen
        time.sleep(0.5)
    raise AssertionError(f"Prometheus targets never matched within {timeout}s: {seen}")


@pytest.mark.prometheus
@pytest.mark.slow
def test_real_prometheus_scrapes_written_targets(prometheus: tuple[int, Path], metrics_server: int) -> None:
    port, targets = prometheus
    write_replica_targets(targets, [_replica(0, f"http://127.0.0.1:{metrics_server}")])

    up = _wait_for(port, lambda ts: any(t["health"] == "up" for t in ts))
    assert len(up) == 1
    target = up[0]
    assert target["scrapeUrl"] == f"http://127.0.0.1:{metrics_server}/metrics"
    assert target["labels"]["replica"] == "llama-0"
    assert target["labels"]["deployment"] == "llama"
    assert target["labels"]["job"] == "sarv-replicas"

    # A replica that goes away disappears from Prometheus without a reload.
    write_replica_targets(targets, [])
    _wait_for(port, lambda ts: ts == [])
