"""The gateway's OpenAI API in front of real simulator replicas: auth, models, adapters, streaming, probes."""

from __future__ import annotations

import json

import httpx
import pytest
from fixtures.gateway import add_key, add_replica, make_store, wait_for

from controlplane.spec import ReplicaState


@pytest.fixture
def setup(tmp_path, sim_server, gateway_factory):
    sim = sim_server(
        served_model_name="m1",
        lora_modules=["ada"],
        latency_mode="fixed",
        fixed_ttft_ms=5,
        fixed_itl_ms=1,
        fixed_output_tokens=8,
    )
    store = make_store(tmp_path)
    add_replica(store, sim.url, "m1", rid="m1-0", adapters=["ada"])
    key = add_key(store, "alice")
    limited = add_key(store, "bob", models=["other"])
    gw = gateway_factory(store)
    return gw, store, key, limited, sim


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_models_lists_served_models_and_adapters(setup):
    gw, _, key, limited, _ = setup
    r = httpx.get(f"{gw.url}/v1/models", headers=_auth(key))
    assert r.status_code == 200
    ids = {m["id"] for m in r.json()["data"]}
    assert ids == {"m1", "ada"}
    ada = next(m for m in r.json()["data"] if m["id"] == "ada")
    assert ada["parent"] == "m1"
    # a key restricted to other models sees none of these
    r = httpx.get(f"{gw.url}/v1/models", headers=_auth(limited))
    assert r.json()["data"] == []


def test_completion_and_chat_reach_the_replica(setup):
    gw, _, key, _, _ = setup
    r = httpx.post(
        f"{gw.url}/v1/completions", headers=_auth(key), json={"model": "m1", "prompt": "hi", "max_tokens": 4}
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
    assert r.headers["x-sarv-replica"] == "m1-0"
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        headers=_auth(key),
        json={"model": "ada", "messages": [{"role": "user", "content": "hello"}]},
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "ada"


def test_stream_is_relayed_as_sse(setup):
    gw, _, key, _, _ = setup
    events = []
    with httpx.stream(
        "POST",
        f"{gw.url}/v1/chat/completions",
        headers=_auth(key),
        json={"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    assert len(events) >= 3
    json.loads(events[0])


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "invalid_api_key"),
        ({"Authorization": "Bearer sk-sarv-nope"}, 401, "invalid_api_key"),
        ({"Authorization": "Basic abc"}, 401, "invalid_api_key"),
    ],
)
def test_missing_or_bad_key_is_401_in_openai_shape(setup, headers, status, code):
    gw, *_ = setup
    r = httpx.post(f"{gw.url}/v1/completions", headers=headers, json={"model": "m1", "prompt": "x"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code
    assert err["type"] == "authentication_error"
    assert err["message"]


def test_model_not_allowed_is_403_and_unknown_model_404(setup):
    gw, _, key, limited, _ = setup
    r = httpx.post(f"{gw.url}/v1/completions", headers=_auth(limited), json={"model": "m1", "prompt": "x"})
    assert r.status_code == 403
    assert r.json()["error"]["type"] == "permission_error"
    r = httpx.post(f"{gw.url}/v1/completions", headers=_auth(key), json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_revoked_and_expired_keys_are_refused(tmp_path, sim_server, gateway_factory):
    from controlplane.gateway import GatewayConfig

    sim = sim_server(served_model_name="m1")
    store = make_store(tmp_path)
    add_replica(store, sim.url, "m1")
    revoked = add_key(store, "gone", revoked=True)
    expired = add_key(store, "old", expires_at=1.0)
    gw = gateway_factory(store, GatewayConfig(key_cache_ttl_s=0))
    for key in (revoked, expired):
        r = httpx.post(f"{gw.url}/v1/completions", headers=_auth(key), json={"model": "m1", "prompt": "x"})
        assert r.status_code == 401


def test_probes_and_metrics(setup):
    gw, store, key, _, _ = setup
    assert httpx.get(f"{gw.url}/health").status_code == 200
    assert httpx.get(f"{gw.url}/ready").status_code == 200
    httpx.post(
        f"{gw.url}/v1/completions", headers=_auth(key), json={"model": "m1", "prompt": "x", "max_tokens": 2}
    )
    text = httpx.get(gw.metrics_url).text
    assert 'sarv_gateway_requests_total{key="alice",model="m1",status="200",team=""} 1.0' in text
    assert 'sarv_gateway_routing_decisions_total{policy="prefix+load",replica="m1-0"}' in text
    assert 'sarv_gateway_replicas{state="ready"} 1.0' in text
    # the replica leaves: /ready turns 503 once discovery notices the new revision
    store.put_replica(store.get_replica("m1-0").model_copy(update={"state": ReplicaState.STOPPING}))
    wait_for(lambda: httpx.get(f"{gw.url}/ready").status_code == 503)
    r = httpx.post(f"{gw.url}/v1/completions", headers=_auth(key), json={"model": "m1", "prompt": "x"})
    assert r.status_code == 404


def test_new_replica_is_discovered_live(setup, sim_server):
    gw, store, key, _, _ = setup
    other = sim_server(served_model_name="m2")
    add_replica(store, other.url, "m2", rid="m2-0")
    wait_for(
        lambda: (
            httpx.post(
                f"{gw.url}/v1/completions",
                headers=_auth(key),
                json={"model": "m2", "prompt": "x", "max_tokens": 1},
            ).status_code
            == 200
        )
    )


def test_wrong_method_and_unknown_route(setup):
    gw, _, key, _, _ = setup
    assert httpx.get(f"{gw.url}/v1/completions", headers=_auth(key)).status_code == 405
    r = httpx.get(f"{gw.url}/v2/whatever")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_embeddings_route_to_an_embedding_replica(tmp_path, sim_server, gateway_factory):
    sim = sim_server(served_model_name="emb", task="embed")
    store = make_store(tmp_path)
    add_replica(store, sim.url, "emb", rid="emb-0")
    key = add_key(store, "e")
    gw = gateway_factory(store)
    r = httpx.post(f"{gw.url}/v1/embeddings", headers=_auth(key), json={"model": "emb", "input": ["a", "b"]})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 2
    r = httpx.post(f"{gw.url}/v1/embeddings", headers=_auth(key), json={"model": "emb", "input": 5})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input"


def test_serving_process_freezes_its_startup_heap(tmp_path, gateway_factory):
    # What `llmctl gateway` does (server.create_app): the start-up heap leaves the collector's reach.
    import gc

    store = make_store(tmp_path)
    threshold = gc.get_threshold()
    gc.unfreeze()
    try:
        gw = gateway_factory(store, tune_gc=True)
        assert httpx.get(f"{gw.url}/health").status_code == 200
        assert gc.get_freeze_count() > 10_000
        assert gc.get_threshold()[0] > threshold[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
