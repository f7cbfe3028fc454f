"""One StateStore contract, run on SQLite, redis-server, Redis Cluster and an ACL-protected redis-server."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from state.records import ACL_PASSWORD, ACL_USER, api_key, deployment, replica

from controlplane.settings import Settings
from controlplane.spec import (
    ReplicaState,
)
from controlplane.state import StateStore, open_store


@dataclass
class Backend:
    """How to open stores on one backend, in this process or in a child process."""

    url: str
    settings: Settings | None = None
    env: dict[str, str] = field(default_factory=dict)
    opened: list[StateStore] = field(default_factory=list)

    def open(self) -> StateStore:
        store = open_store(self.url, self.settings)
        self.opened.append(store)
        return store


def _settings(prefix: str, **extra: object) -> Settings:
    return Settings(state_prefix=prefix, **extra)  # type: ignore[arg-type]


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.redis),
        pytest.param("redis-acl", marks=pytest.mark.redis),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    # A fresh key prefix per test isolates tests on the shared servers (and exercises state_prefix).
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    env = {"SARV_STATE_PREFIX": prefix}
    if request.param == "sqlite":
        b = Backend(url=f"sqlite:///{tmp_path / 'state' / 'state.db'}", settings=_settings(prefix), env=env)
    elif request.param == "redis":
        b = Backend(url=request.getfixturevalue("redis_url"), settings=_settings(prefix), env=env)
    elif request.param == "cluster":
        b = Backend(url=request.getfixturevalue("redis_cluster").url, settings=_settings(prefix), env=env)
    else:
        port = request.getfixturevalue("acl_redis")
        creds = {"redis_username": ACL_USER, "redis_password": ACL_PASSWORD}
        env |= {"SARV_REDIS_USERNAME": ACL_USER, "SARV_REDIS_PASSWORD": ACL_PASSWORD}
        b = Backend(url=f"redis://127.0.0.1:{port}/0", settings=_settings(prefix, **creds), env=env)
    yield b
    for store in b.opened:
        store.close()


@pytest.fixture
def store(backend: Backend) -> StateStore:
    return backend.open()


def test_protocol_and_empty_store(store: StateStore) -> None:
    assert isinstance(store, StateStore)
    store.ping()
    assert store.revision() == 0
    assert store.list_deployments() == []
    assert store.list_replicas() == []
    assert store.list_api_keys() == []
    assert store.get_deployment("x") is None
    assert store.get_replica("x-0") is None
    assert store.get_api_key("0" * 64) is None
    assert store.get_api_key_by_name("x") is None


def test_events_filter_order_limit_and_no_revision_bump(store: StateStore) -> None:
    from controlplane.state.base import EventRecord

    t0 = time.time()  # Redis streams index by the server's clock, so events carry real times
    rev = store.revision()
    for i, dep in enumerate(["a", "b", "a", None, "a"]):
        store.append_event(
            EventRecord(at=t0 + i, reason="Scaled", message=f"m{i}", deployment=dep, source="controller")
        )
    assert store.revision() == rev, "an event is not a state change"
    assert [e.message for e in store.list_events()] == ["m0", "m1", "m2", "m3", "m4"]
    assert [e.message for e in store.list_events("a")] == ["m0", "m2", "m4"]
    assert [e.message for e in store.list_events("a", since=t0 + 1)] == ["m2", "m4"]
    assert [e.message for e in store.list_events(limit=2)] == ["m3", "m4"], "the newest, oldest first"
    assert store.list_events("zzz") == []
    got = store.list_events("b")[0]
    assert (got.type, got.reason, got.source) == ("Normal", "Scaled", "controller")


def test_nodes_round_trip_and_bump_the_revision(store: StateStore) -> None:
    from controlplane.state.base import NodeRecord

    assert store.get_node("gpu-a") is None, "a node without a record is schedulable"
    rev = store.revision()
    store.put_node(NodeRecord(name="gpu-b", schedulable=False, reason="drain", updated_at=1.0))
    store.put_node(NodeRecord(name="gpu-a", schedulable=False))
    assert store.revision() > rev
    store.put_node(NodeRecord(name="gpu-a"))
    assert [(n.name, n.schedulable) for n in store.list_nodes()] == [("gpu-a", True), ("gpu-b", False)]
    assert store.get_node("gpu-b") == NodeRecord(
        name="gpu-b", schedulable=False, reason="drain", updated_at=1.0
    )


def test_rollouts_round_trip_and_bump_the_revision(store: StateStore) -> None:
    from controlplane.spec import RolloutRecord, RolloutStatus, spec_version

    stable = deployment("web", replicas=2).spec
    canary = stable.model_copy(update={"engine_args": {"ttft_ms": 40}})
    record = RolloutRecord(
        deployment="web",
        stable=stable,
        canary=canary,
        stable_version=spec_version(stable),
        canary_version=spec_version(canary),
        comparison={"canary_ttft_p95_s": 0.04, "stable_ttft_p95_s": None},
        started_at=1.0,
    )
    assert store.get_rollout("web") is None
    rev = store.revision()
    store.put_rollout(record)
    assert store.revision() > rev
    assert store.get_rollout("web") == record
    store.put_rollout(record.model_copy(update={"step": 1, "status": RolloutStatus.ROLLING_BACK}))
    assert [(r.deployment, r.step, r.status) for r in store.list_rollouts()] == [
        ("web", 1, RolloutStatus.ROLLING_BACK)
    ]
    assert store.delete_rollout("web") is True
    assert store.delete_rollout("web") is False
    assert store.list_rollouts() == []


def test_usage_adds_up_per_hour_key_team_model(backend: Backend) -> None:
    from controlplane.state.base import UsageRecord

    store = backend.open()
    h = 1_700_002_800  # an hour's start
    rev = store.revision()
    row = UsageRecord(hour=h, key="bot", team="ml", model="m1", requests=2, prompt_tokens=30,
                      completion_tokens=5, errors=1, rejected=0, cost=0.25)  # fmt: skip
    other = UsageRecord(hour=h + 3600, key='we"ird]|key', team="", model="m2", requests=1, rejected=1)
    store.add_usage([row, other])
    store.add_usage([row.model_copy(update={"requests": 1, "cost": 0.5})])
    store.add_usage([])
    assert store.revision() == rev, "usage is not a state change"
    got = store.list_usage()
    assert [(r.hour, r.key, r.team, r.model) for r in got] == [
        (h, "bot", "ml", "m1"),
        (h + 3600, 'we"ird]|key', "", "m2"),
    ]
    first = got[0]
    assert (first.requests, first.prompt_tokens, first.completion_tokens, first.errors, first.rejected) == (
        3, 60, 10, 2, 0
    )  # fmt: skip
    assert first.cost == pytest.approx(0.75)
    assert (got[1].requests, got[1].rejected, got[1].prompt_tokens) == (1, 1, 0)
    assert [r.key for r in store.list_usage(since=h + 1)] == ["bot", 'we"ird]|key'], "since's whole hour"
    assert [r.key for r in store.list_usage(since=h + 3600)] == ['we"ird]|key']
    assert [r.key for r in store.list_usage(until=h + 3600)] == ["bot"]
    # persistent: another store (a restarted gateway) reads the same rows
    assert backend.open().list_usage() == got


def test_deployments_round_trip(store: StateStore) -> None:
    store.put_deployment(deployment("beta"))
    store.put_deployment(deployment("alpha"))
    assert store.get_deployment("alpha") == deployment("alpha")
    assert [d.name for d in store.list_deployments()] == ["alpha", "beta"]
    store.put_deployment(deployment("alpha", replicas=3))
    got = store.get_deployment("alpha")
    assert got is not None and got.spec.replicas == 3
    assert store.delete_deployment("alpha") is True
    assert store.delete_deployment("alpha") is False
    assert store.get_deployment("alpha") is None
    assert [d.name for d in store.list_deployments()] == ["beta"]


def test_replicas_round_trip_and_filter(store: StateStore) -> None:
    for rec in (replica("a", 1), replica("a", 0), replica("b", 0)):
        store.put_replica(rec)
    assert store.get_replica("a-0") == replica("a", 0)
    assert [r.id for r in store.list_replicas()] == ["a-0", "a-1", "b-0"]
    assert [r.id for r in store.list_replicas("a")] == ["a-0", "a-1"]
    assert store.list_replicas("zzz") == []
    store.put_replica(replica("a", 0, ReplicaState.UNHEALTHY))
    got = store.get_replica("a-0")
    assert got is not None and got.state is ReplicaState.UNHEALTHY
    assert store.delete_replica("a-0") is True
    assert store.delete_replica("a-0") is False
    assert [r.id for r in store.list_replicas("a")] == ["a-1"]


def test_api_keys_lookup_rotation_and_rename(store: StateStore) -> None:
    store.put_api_key(api_key("ci", "a"))
    store.put_api_key(api_key("alice", "b"))
    assert store.get_api_key("a" * 64) == api_key("ci", "a")
    assert store.get_api_key_by_name("alice") == api_key("alice", "b")
    assert [k.name for k in store.list_api_keys()] == ["alice", "ci"]
    # Rotation: a new secret under the same name retires the old one.
    store.put_api_key(api_key("ci", "c"))
    assert store.get_api_key("a" * 64) is None
    rotated = store.get_api_key_by_name("ci")
    assert rotated is not None and rotated.key_hash == "c" * 64
    # Rename: the same secret under a new name frees the old name.
    store.put_api_key(api_key("bob", "b"))
    assert store.get_api_key_by_name("alice") is None
    assert [k.name for k in store.list_api_keys()] == ["bob", "ci"]
    revoked = api_key("bob", "b").model_copy(update={"revoked": True})
    store.put_api_key(revoked)
    got = store.get_api_key("b" * 64)
    assert got is not None and got.revoked


def test_revision_is_monotonic_and_counts_changes(store: StateStore) -> None:
    seen = [store.revision()]

    def step() -> None:
        seen.append(store.revision())

    store.put_deployment(deployment("a"))
    step()
    store.put_replica(replica("a", 0))
    step()
    store.put_api_key(api_key("k", "d"))
    step()
    store.list_deployments()
    store.get_replica("a-0")
    step()  # reads change nothing
    store.delete_replica("a-0")
    step()
    store.delete_replica("a-0")
    step()  # deleting nothing changes nothing
    store.put_deployment(deployment("a"))
    step()  # an identical rewrite is still a write
    assert seen == [0, 1, 2, 3, 3, 4, 4, 5]


def test_two_stores_share_state(backend: Backend) -> None:
    first, second = backend.open(), backend.open()
    first.put_deployment(deployment("shared"))
    assert second.get_deployment("shared") == deployment("shared")
    assert second.revision() == first.revision() == 1


def test_concurrent_threads(backend: Backend) -> None:
    store = backend.open()
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(20):
                store.put_replica(replica(f"t{t}", i))
                store.revision()
        except BaseException as exc:  # collected and re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors
    assert len(store.list_replicas()) == 120
    assert store.revision() == 120


_CHILD = """
import json, sys
from controlplane.settings import load_settings
from controlplane.spec import EngineKind, ReplicaRecord
from controlplane.state import open_store

url, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = open_store(url, load_settings())
revisions = []
for i in range(count):
    store.put_replica(ReplicaRecord(id=f"{name}-{i}", deployment=name, index=i, model="m",
                                    engine=EngineKind.SIM, node="n"))
    revisions.append(store.revision())
store.close()
print(json.dumps(revisions))
"""


def test_concurrent_processes(backend: Backend) -> None:
    store = backend.open()
    env = {**os.environ, **backend.env, "SARV_CONFIG": ""}
    env.pop("SARV_CONFIG")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, backend.url, f"p{n}", "25"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(3)
    ]
    for i in range(25):
        store.put_replica(replica("main", i))
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out))
    assert len(store.list_replicas()) == 100
    assert store.revision() == 100
    for revisions in outputs:
        # Each process sees its own writes in order: its revisions strictly increase.
        assert all(a < b for a, b in itertools.pairwise(revisions))


def test_close_then_new_store_sees_data(backend: Backend) -> None:
    store = backend.open()
    store.put_api_key(api_key("persist", "e"))
    store.close()
    again = backend.open()
    assert again.get_api_key_by_name("persist") == api_key("persist", "e")
    assert again.revision() == 1


def test_wake_requests_keep_the_newest_ask_clear_and_bump_no_revision(store: StateStore) -> None:
    rev = store.revision()
    assert store.list_wake_requests() == {}
    store.request_wake("web", 10.0)
    store.request_wake("web", 12.5)
    store.request_wake("chat", 11.0)
    assert store.list_wake_requests() == {"web": 12.5, "chat": 11.0}
    store.clear_wake_request("web")
    store.clear_wake_request("absent")
    assert store.list_wake_requests() == {"chat": 11.0}
    assert store.revision() == rev
