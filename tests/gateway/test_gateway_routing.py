"""Routing: policies, prefix affinity blended with load, saturation, ejection, retries, cancellation."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fixtures.common import free_port
from fixtures.gateway import add_key, add_replica, make_store, wait_for

from controlplane.engines.metrics import parse_vllm_metrics
from controlplane.gateway.config import RoutingConfig, RoutingPolicy
from controlplane.gateway.routing import Router
from controlplane.gateway.tokens import chain_hashes
from controlplane.spec import EngineKind, ReplicaRecord, ReplicaState


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _rec(i: int, model: str = "m", capacity: float = 1.0, adapters: list[str] | None = None) -> ReplicaRecord:
    return ReplicaRecord(
        id=f"r{i}",
        deployment="d",
        index=i,
        model=model,
        engine=EngineKind.SIM,
        node="n",
        endpoint=f"http://127.0.0.1:{9000 + i}",
        state=ReplicaState.READY,
        capacity=capacity,
        adapters=adapters or [],
    )


def _router(n: int, policy: RoutingPolicy = RoutingPolicy.PREFIX_LOAD, **kw) -> tuple[Router, Clock]:
    clock = Clock()
    r = Router(RoutingConfig(policy=policy, **kw), monotonic=clock)
    r.set_replicas([_rec(i) for i in range(n)])
    return r, clock


def _blocks(text: str) -> list[int]:
    return chain_hashes(text.encode(), 64, 256)


def test_round_robin_cycles():
    r, _ = _router(3, RoutingPolicy.ROUND_ROBIN)
    assert [r.pick("m", []).id for _ in range(6)] == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_least_load_picks_the_idlest_per_capacity():
    clock = Clock()
    r = Router(RoutingConfig(policy=RoutingPolicy.LEAST_LOAD), monotonic=clock)
    r.set_replicas([_rec(0, capacity=1.0), _rec(1, capacity=4.0)])
    big, small = r.replicas[1], r.replicas[0]
    for _ in range(3):
        r.on_start(big, 10, [])
    r.on_start(small, 10, [])
    # 3 requests on a 4× replica (0.75 per unit) are less load than 1 on a 1× replica
    assert r.pick("m", []).id == "r1"


def test_prefix_affinity_follows_the_shared_prompt():
    r, _ = _router(4)
    system = "You are a helpful assistant. " * 40
    first = r.pick("m", _blocks(system + "question one"))
    r.on_start(first, 10, _blocks(system + "question one"))
    r.on_finish(first, 10)
    for q in ("two", "three", "four"):
        b = _blocks(system + "question " + q)
        assert r.pick("m", b) is first
    # an unrelated prompt is free to go elsewhere (ties rotate)
    others = {r.pick("m", _blocks("x" * 2000 + str(i))).id for i in range(8)}
    assert len(others) > 1


def test_affinity_yields_to_load_and_saturation():
    r, _clock = _router(2, load_guard_spread=4)
    b = _blocks("shared prefix " * 100)
    hot = r.pick("m", b)
    for _ in range(6):  # pile requests on the affine replica
        r.on_start(hot, 10, b)
    assert r.pick("m", b) is not hot  # AIBrix's guard: busiest − idlest > 4
    r2, clock2 = _router(2)
    hot = r2.pick("m", b)
    r2.on_start(hot, 10, b)
    assert r2.pick("m", b) is hot
    # the replica reports a deep waiting queue (fresh metrics): the saturation filter drops its affinity
    r2.observe(hot.id, waiting=10, running=8, kv=0.5)
    assert r2.pick("m", b) is not hot
    # stale metrics are ignored again
    clock2.t += 5
    assert r2.pick("m", b) is hot


def test_ejection_and_return():
    r, clock = _router(2, eject_after_failures=2, eject_s=10)
    bad = r.replicas[0]
    assert not r.on_failure(bad)
    assert r.on_failure(bad)
    assert {r.pick("m", []).id for _ in range(6)} == {"r1"}
    clock.t += 11
    assert {r.pick("m", []).id for _ in range(6)} == {"r0", "r1"}


def test_adapters_route_only_to_replicas_serving_them():
    r = Router(RoutingConfig())
    r.set_replicas([_rec(0, adapters=["sql"]), _rec(1)])
    assert r.serves("sql")
    assert {r.pick("sql", []).id for _ in range(5)} == {"r0"}
    assert r.pick("nope", []) is None


def test_replica_set_update_keeps_state_and_forgets_the_gone():
    r, _ = _router(3)
    b = _blocks("p" * 1000)
    keep = r.replicas[1]
    r.on_start(keep, 5, b)
    r.set_replicas([_rec(1), _rec(2)])
    assert r.replicas[0] is keep
    assert keep.outstanding == 1
    r.set_replicas([_rec(2)])
    assert r._index == {}  # its prefix history is gone with it


def test_parse_vllm_metrics():
    text = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="0",model_name="m"} 5.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    )
    load = parse_vllm_metrics(text)
    assert load is not None
    assert (load.waiting, load.running, load.kv_cache_usage) == (3.0, 5.0, 0.25)
    assert parse_vllm_metrics("foo 1\n") is None


@pytest.fixture
def two_sims(tmp_path, sim_server, gateway_factory):
    store = make_store(tmp_path)
    sims = [
        sim_server(
            served_model_name="m",
            latency_mode="fixed",
            fixed_ttft_ms=1,
            fixed_itl_ms=20,
            fixed_output_tokens=200,
        )
        for _ in range(2)
    ]
    for i, s in enumerate(sims):
        add_replica(store, s.url, "m", rid=f"m-{i}")
    key = add_key(store, "k")
    return store, sims, key, gateway_factory


def _running(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    load = parse_vllm_metrics(text)
    assert load is not None and load.running is not None
    return load.running


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("http", ["gateway", "httptools"])
def test_client_disconnect_cancels_the_upstream_request(two_sims, http, stream):
    """The gateway's protocol tells the request of its client's loss; under another ASGI server a task
    per request waits for ``http.disconnect``. Either way the replica stops generating."""
    store, sims, key, start = two_sims
    gw = start(store, **({} if http == "gateway" else {"http": http}))
    if not stream:
        with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
            body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 200}).encode()
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_for(lambda: sum(_running(sim.url) for sim in sims) == 1, timeout=3)
            t0 = time.monotonic()
        # the request ends as the client's (499) within a second, not after the 4 s answer; the connection
        # to the replica is closed with it (the simulator, unlike vLLM, finishes a whole answer regardless)
        wait_for(lambda: 'status="499"' in httpx.get(gw.metrics_url).text, timeout=3)
        assert time.monotonic() - t0 < 1.5
        return
    with httpx.stream(
        "POST",
        f"{gw.url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "m", "prompt": "x", "max_tokens": 200, "stream": True},
    ) as r:
        replica = r.headers["x-sarv-replica"]
        sim = sims[int(replica.rsplit("-", 1)[1])]
        chunks = r.iter_bytes()  # keep the iterator alive: a dropped generator would close the stream
        next(chunks)
        wait_for(lambda: _running(sim.url) == 1, timeout=3)
        t0 = time.monotonic()
    # the client is gone: within a second the replica stops generating (200 tokens would take 4 s)
    wait_for(lambda: _running(sim.url) == 0, timeout=3)
    assert time.monotonic() - t0 < 1.5


def test_dead_replica_is_retried_elsewhere_and_ejected(two_sims):
    store, _sims, key, start = two_sims
    add_replica(store, f"http://127.0.0.1:{free_port()}", "m", rid="m-dead")
    from controlplane.gateway import GatewayConfig

    gw = start(
        store, GatewayConfig(routing=RoutingConfig(policy=RoutingPolicy.ROUND_ROBIN, eject_after_failures=1))
    )
    for _ in range(6):
        r = httpx.post(
            f"{gw.url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "m", "prompt": "x", "max_tokens": 1},
        )
        assert r.status_code == 200
        assert r.headers["x-sarv-replica"] != "m-dead"
    text = httpx.get(gw.metrics_url).text
    assert "sarv_gateway_retries_total 1.0" in text  # ejected after the first failure: one retry only
    assert 'sarv_gateway_upstream_errors_total{replica="m-dead"} 1.0' in text
