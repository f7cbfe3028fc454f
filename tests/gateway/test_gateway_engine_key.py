"""The gateway presents each deployment's engine key to its replicas; keyless ones are reached as before."""

from __future__ import annotations

import httpx
from fixtures.gateway import add_key, add_replica, make_store
from pydantic import SecretStr

_CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_gateway_presents_the_engine_key(tmp_path, sim_server, gateway_factory, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "engine-secret-1")
    sim = sim_server(served_model_name="m1")
    monkeypatch.delenv("VLLM_API_KEY")
    assert httpx.post(f"{sim.url}/v1/chat/completions", json=_CHAT, timeout=30).status_code == 401
    store = make_store(tmp_path)
    store.put_engine_key("m1", SecretStr("engine-secret-1"))
    add_replica(store, sim.url, "m1", rid="m1-0")
    key = add_key(store, "alice")
    gw = gateway_factory(store)
    auth = {"Authorization": f"Bearer {key}"}
    resp = httpx.post(f"{gw.url}/v1/chat/completions", json=_CHAT, headers=auth, timeout=30)
    assert resp.status_code == 200, resp.text
    # the model card (read from the replica's /v1/models with the key) carries its context length
    models = httpx.get(f"{gw.url}/v1/models", headers=auth, timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["m1"]


def test_a_replica_deployed_before_engine_keys_is_still_reached(tmp_path, sim_server, gateway_factory):
    sim = sim_server(served_model_name="m1")
    store = make_store(tmp_path)
    add_replica(store, sim.url, "m1", rid="m1-0")
    key = add_key(store, "alice")
    gw = gateway_factory(store)
    resp = httpx.post(
        f"{gw.url}/v1/chat/completions", json=_CHAT, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    assert resp.status_code == 200, resp.text
