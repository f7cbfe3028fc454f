"""The health rule, and that the reconcile loop and ``llmctl status`` apply it alike (real HTTP stubs)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.cli.runtime import status_document
from controlplane.controller import Deployer
from controlplane.controller.health import HealthRule, Streak, judge, probe_path
from controlplane.controller.reconcile import ControllerConfig, Reconciler
from controlplane.engines.base import EngineLaunch, ReplicaContext
from controlplane.launchers.base import ProcessState, ReplicaProcess
from controlplane.settings import Settings
from controlplane.spec import (
    DeploymentRecord,
    DeploymentSpec,
    EngineKind,
    Fleet,
    ModelSpec,
    Node,
    Plan,
    ProbePaths,
    ReplicaPlan,
    ReplicaRecord,
    ReplicaState,
    Shard,
)
from controlplane.state import StateStore, open_store

READY, STARTING, UNHEALTHY = ReplicaState.READY, ReplicaState.STARTING, ReplicaState.UNHEALTHY


class Stub:
    """An HTTP server answering each path with a settable status code (404 for unknown paths)."""

    def __init__(self, codes: dict[str, int]) -> None:
        self.codes = dict(codes)
        self.seen: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stub.seen.append(self.path)
                code = stub.codes.get(self.path, 404)
                body = b'{"data": []}' if code == 200 else b""
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub({"/health": 200, "/v1/models": 200})
    yield s
    s.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    s = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    yield s
    s.close()


class RunningLauncher:
    """Stands in for a launcher whose processes are all alive; starting one records nothing else."""

    name = "stub"
    host = "127.0.0.1"

    def __init__(self, port: int) -> None:
        self.port = port
        self.launches: list[EngineLaunch] = []

    def allocate_port(self, preferred: int | None = None) -> int:
        return self.port

    def ensure_weights(self, *args: object, **kwargs: object) -> Path:
        raise AssertionError("the stub engine needs no weights")

    def start(self, replica_id: str, launch: EngineLaunch) -> dict[str, str]:
        self.launches.append(launch)
        return {"launcher": self.name, "pid": "1"}

    def poll(self, handle: dict[str, str]) -> ReplicaProcess:
        return ReplicaProcess(state=ProcessState.RUNNING)

    def stop(self, handle: dict[str, str], *, timeout: float = 30.0) -> None:
        pass

    def logs(self, handle: dict[str, str], *, follow: bool = False, tail: int = 200) -> Iterator[str]:
        return iter(())


class PathsEngine:
    """An engine kind declaring its own probe paths."""

    kind = EngineKind.SIM
    needs_weights = False
    multi_node = False

    def __init__(self, probes: ProbePaths) -> None:
        self.probes = probes

    def build(self, ctx: ReplicaContext) -> EngineLaunch:
        return EngineLaunch(argv=["engine"], port=ctx.port, probes=self.probes)


_MODEL = ModelSpec(
    name="m",
    num_layers=2,
    hidden_size=256,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=512,
    vocab_size=512,
    num_params=1_000_000,
    max_model_len=2048,
)


class OneModel:
    def get(self, name: str) -> ModelSpec:
        return _MODEL


def _plan(fleet: Fleet, spec: DeploymentSpec, model: ModelSpec, placed: list[ReplicaRecord]) -> Plan:
    shards = [Shard(node="n1", gpus=[], pp_rank=0)]
    rp = ReplicaPlan(tp=1, pp=1, shards=shards, per_gpu_memory_gib=0.0, max_concurrency=1)
    return Plan(model=model.name, deployment=spec.name, replicas=[rp])


def deployer(tmp_path: Path, store: StateStore, stub: Stub, engine: PathsEngine | None = None) -> Deployer:
    launcher = RunningLauncher(int(stub.url.rsplit(":", 1)[1]))
    return Deployer(
        settings=Settings(home=tmp_path / "home"),
        store=store,
        fleet=Fleet(nodes=[Node(name="n1", address="127.0.0.1")]),
        catalog=OneModel(),
        planner=_plan,
        launcher_factory=lambda node: launcher,
        engines={EngineKind.SIM: engine or PathsEngine(ProbePaths())},
        sleep=lambda s: None,
    )


def put_ready_replica(store: StateStore, stub: Stub, state: ReplicaState = READY) -> ReplicaRecord:
    spec = DeploymentSpec(name="m", model="m", engine=EngineKind.SIM)
    store.put_deployment(DeploymentRecord(spec=spec, plan=Plan(model="m", deployment="m")))
    rec = ReplicaRecord(
        id="m-0",
        deployment="m",
        index=0,
        model="m",
        engine=EngineKind.SIM,
        node="n1",
        endpoint=stub.url,
        state=state,
        handle={"launcher": "stub", "pid": "1"},
        created_at=1.0,
        updated_at=1.0,
    )
    store.put_replica(rec)
    return rec


# --- the rule itself


@pytest.mark.parametrize(
    ("state", "ok", "streak", "rule", "expected"),
    [
        (STARTING, True, Streak(), HealthRule(), READY),
        (STARTING, False, Streak(), HealthRule(failure_threshold=1), STARTING),
        (READY, False, Streak(), HealthRule(failure_threshold=3), READY),
        (READY, False, Streak(failures=2), HealthRule(failure_threshold=3), UNHEALTHY),
        (READY, False, Streak(), HealthRule(failure_threshold=1), UNHEALTHY),
        (UNHEALTHY, True, Streak(), HealthRule(success_threshold=2), UNHEALTHY),
        (UNHEALTHY, True, Streak(successes=1), HealthRule(success_threshold=2), READY),
        (ReplicaState.FAILED, True, Streak(), HealthRule(), ReplicaState.FAILED),
    ],
)
def test_rule_transitions(
    state: ReplicaState, ok: bool, streak: Streak, rule: HealthRule, expected: ReplicaState
) -> None:
    assert judge(rule, state, "", ok=ok, error="HTTP 503", streak=streak).state is expected


def test_a_success_resets_the_failure_streak_and_the_message_says_why() -> None:
    rule = HealthRule(failure_threshold=2)
    v = judge(rule, READY, "", ok=False, error="HTTP 503")
    assert v.streak == Streak(failures=1)
    v = judge(rule, READY, "", ok=True, streak=v.streak)
    assert v.streak == Streak(successes=1)
    v = judge(rule, READY, "", ok=False, error="HTTP 503", streak=v.streak)
    assert v.state is READY
    v = judge(rule, READY, "", ok=False, error="HTTP 503", streak=v.streak)
    assert (v.state, v.message) == (UNHEALTHY, "health check failed 2 times in a row: HTTP 503")


def test_probe_path_comes_from_the_record() -> None:
    paths = ProbePaths(health="/alive", ready="/loaded", metrics="/stats")
    rec = ReplicaRecord(id="a-0", deployment="a", index=0, model="a", engine=EngineKind.SIM, node="n")
    assert probe_path(rec.model_copy(update={"probes": paths, "state": STARTING})) == "/loaded"
    assert probe_path(rec.model_copy(update={"probes": paths, "state": READY})) == "/alive"
    # A record stored before records carried paths reads back with vLLM's.
    old = ReplicaRecord.model_validate(rec.model_dump(exclude={"probes"}) | {"state": "starting"})
    assert probe_path(old) == "/v1/models"


# --- llmctl status


def test_one_failed_health_check_seen_by_status_does_not_mark_a_replica_unhealthy(
    tmp_path: Path, store: StateStore, stub: Stub
) -> None:
    put_ready_replica(store, stub)
    stub.codes["/health"] = 503
    doc = status_document(deployer(tmp_path, store, stub))
    [rep] = doc["deployments"][0]["replicas"]
    assert rep["state"] == "ready"
    assert rep["probe"] == {"path": "/health", "ok": False, "error": "HTTP 503"}
    got = store.get_replica("m-0")
    assert got is not None and (got.state, got.message, got.updated_at) == (READY, "", 1.0)


def test_status_persists_only_what_the_rule_decides(tmp_path: Path, store: StateStore, stub: Stub) -> None:
    put_ready_replica(store, stub)
    stub.codes["/health"] = 503
    [after] = deployer(tmp_path, store, stub).refresh(rule=HealthRule(failure_threshold=1))
    assert after.state is UNHEALTHY
    assert after.message == "health check failed 1 times in a row: HTTP 503"
    stub.codes["/health"] = 200
    [back] = deployer(tmp_path, store, stub).refresh()
    assert (back.state, back.message) == (READY, "")


def test_status_judges_a_loading_replica_by_its_ready_path(
    tmp_path: Path, store: StateStore, stub: Stub
) -> None:
    put_ready_replica(store, stub, state=STARTING)
    stub.codes["/v1/models"] = 503  # /health already answers, as vLLM's does while the model loads
    [rec] = deployer(tmp_path, store, stub).refresh()
    assert rec.state is STARTING
    stub.codes["/v1/models"] = 200
    [rec] = deployer(tmp_path, store, stub).refresh()
    assert rec.state is READY


# --- the engine's paths, recorded once and used by the deployer and the loop


def test_deploy_records_the_engines_paths_and_awaits_its_ready_path(
    tmp_path: Path, store: StateStore
) -> None:
    paths = ProbePaths(health="/alive", ready="/loaded", metrics="/stats")
    stub = Stub({"/alive": 200, "/loaded": 200})
    try:
        d = deployer(tmp_path, store, stub, PathsEngine(paths))
        result = d.deploy(DeploymentSpec(name="m", model="m", engine=EngineKind.SIM), timeout=5)
        [rec] = result.replicas
        assert (rec.state, rec.probes) == (READY, paths)
        assert stub.seen == ["/loaded"]
        stored = store.get_replica(rec.id)
        assert stored is not None and stored.probes == paths
    finally:
        stub.close()


async def test_the_loop_probes_the_paths_the_record_carries(store: StateStore) -> None:
    paths = ProbePaths(health="/alive", ready="/loaded", metrics="/stats")
    stub = Stub({"/alive": 200})  # the default /health would answer 404
    try:
        rec = put_ready_replica(store, stub)
        store.put_replica(rec.model_copy(update={"probes": paths}))
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            loop = Reconciler(store=store, client=client, config=ControllerConfig(failure_threshold=1))
            report = await loop.run_once()
        assert report.failed_phases == []
        got = store.get_replica("m-0")
        assert got is not None and got.state is READY
        assert stub.seen == ["/alive", "/stats"]
    finally:
        stub.close()
