"""Adversarial inputs: each client mistake is a 4xx naming the problem, never a 5xx; others are served."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from fixtures.gateway import add_key, add_replica, make_store

from controlplane.gateway import GatewayConfig
from controlplane.gateway.config import LimitsConfig


@pytest.fixture(scope="module")
def gw(tmp_path_factory, module_sims, module_gateways):
    tmp_path = tmp_path_factory.mktemp("gw")
    sim = module_sims(
        served_model_name="m1",
        max_model_len=512,
        latency_mode="fixed",
        fixed_ttft_ms=2,
        fixed_itl_ms=1,
        fixed_output_tokens=4,
    )
    store = make_store(tmp_path)
    add_replica(store, sim.url, "m1", rid="m1-0")
    key = add_key(store, "alice")
    capped = add_key(store, "capped", max_prompt_tokens=10)
    config = GatewayConfig(
        limits=LimitsConfig(max_body_bytes=64 * 1024, body_timeout_s=1.0, max_header_bytes=8192)
    )
    g = module_gateways(store, config)
    g.key = key
    g.capped = capped
    return g


def _post(gw, path, body, key=None, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{gw.url}{path}",
        content=content,
        headers={"Authorization": f"Bearer {key or gw.key}", "Content-Type": "application/json"},
        **kw,
    )


BAD = [
    (b"{", "invalid_json", None),
    (b'{"model": "m1", "prompt": "x"', "invalid_json", None),
    (b"[1, 2]", "invalid_value", None),
    (b"null", "invalid_value", None),
    ({"prompt": "x"}, "invalid_value", "model"),
    ({"model": 5, "prompt": "x"}, "invalid_value", "model"),
    ({"model": "m1"}, "invalid_value", "prompt"),
    ({"model": "m1", "prompt": {"a": 1}}, "invalid_value", "prompt"),
    ({"model": "m1", "prompt": "x", "max_tokens": "5"}, "invalid_value", "max_tokens"),
    ({"model": "m1", "prompt": "x", "max_tokens": -1}, "invalid_value", "max_tokens"),
    ({"model": "m1", "prompt": "x", "max_tokens": 0}, "invalid_value", "max_tokens"),
    ({"model": "m1", "prompt": "x", "max_tokens": 10**12}, "invalid_value", "max_tokens"),
    ({"model": "m1", "prompt": "x", "n": 10**6}, "invalid_value", "n"),
    ({"model": "m1", "prompt": "x", "best_of": 10**6}, "invalid_value", "best_of"),
    ({"model": "m1", "prompt": "x", "logprobs": 10**6}, "invalid_value", "logprobs"),
    ({"model": "m1", "prompt": "x", "stop": ["a"] * 100}, "invalid_value", "stop"),
    ({"model": "m1", "prompt": "x", "stream": "yes"}, "invalid_value", "stream"),
    ({"model": "m1", "prompt": "x", "temperature": 99}, "invalid_value", "temperature"),
    ({"model": "m1", "prompt": "x", "temperature": "hot"}, "invalid_value", "temperature"),
]


@pytest.mark.parametrize(("body", "code", "param"), BAD)
def test_malformed_bodies_are_400_naming_the_field(gw, body, code, param):
    r = _post(gw, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
        assert param in err["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m1", "messages": []},
        {"model": "m1", "messages": [{"content": "no role"}]},
        {"model": "m1", "messages": [{"role": "wizard", "content": "x"}]},
        {"model": "m1", "messages": [{"role": "", "content": "x"}]},
        {"model": "m1", "messages": "hello"},
        {"model": "m1", "messages": [{"role": "user", "content": 5}]},
        {"model": "m1", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 10**6},
    ],
)
def test_bad_chat_bodies_are_400(gw, body):
    r = _post(gw, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"]


def test_an_unknown_role_is_400_naming_the_field(gw):
    r = _post(gw, "/v1/chat/completions", {"model": "m1", "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith("messages") and "role" in err["param"], err


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "m1", "prompt": "x", "stream": None, "n": None}),
        (
            "/v1/chat/completions",
            {"model": "m1", "messages": [{"role": "user", "content": "x"}], "stream": None},
        ),
        (
            "/v1/chat/completions",
            {"model": "m1", "messages": [{"role": "developer", "content": "x"}], "n": None},
        ),
    ],
)
def test_null_optional_fields_are_accepted_as_unset(gw, path, body):
    r = _post(gw, path, body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")  # null stream is not a stream


def test_prompt_over_context_is_400_with_both_numbers(gw):
    r = _post(gw, "/v1/completions", {"model": "m1", "prompt": "word " * 100_00})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "512" in msg  # the model's context, learnt from the replica's /v1/models
    assert "6250" in msg  # 50,000 bytes ÷ 8 bytes per token: the lower bound without a tokenizer


def test_prompt_over_the_keys_cap_is_400_with_both_numbers(gw):
    r = _post(gw, "/v1/completions", {"model": "m1", "prompt": "x" * 800}, key=gw.capped)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "prompt_too_long"
    assert "100" in err["message"]
    assert "10" in err["message"]


def test_huge_body_is_413_without_reading_it(gw):
    r = _post(gw, "/v1/completions", b"x" * (65 * 1024))
    assert r.status_code == 413

    # chunked upload without Content-Length: cut off while reading
    def gen():
        for _ in range(100):
            yield b"y" * 1024

    r = httpx.post(f"{gw.url}/v1/completions", content=gen(), headers={"Authorization": f"Bearer {gw.key}"})
    assert r.status_code == 413


def test_huge_headers_are_431(gw):
    r = httpx.post(
        f"{gw.url}/v1/completions",
        json={"model": "m1", "prompt": "x"},
        headers={"Authorization": f"Bearer {gw.key}", "X-Junk": "j" * 20000},
    )
    assert r.status_code == 431


@pytest.fixture(scope="module")
def plain_gw(tmp_path_factory, gw, module_gateways):
    """The same app under uvicorn's own protocol (another ASGI server): the body deadline is the app's."""
    g = module_gateways(gw.app.store, gw.app.config, http="httptools")
    g.key = gw.key
    return g


@pytest.mark.parametrize("server", ["gw", "plain_gw"])
def test_slow_client_trickling_its_body_gets_408_and_others_are_served(request, server):
    gw = request.getfixturevalue(server)
    body = json.dumps({"model": "m1", "prompt": "hello", "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {gw.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        s.sendall(head + body[:5])
        # while this client stalls, another one is answered
        ok = _post(gw, "/v1/completions", {"model": "m1", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
        s.settimeout(10)
        reply = b""
        deadline = time.monotonic() + 10
        while b"\r\n\r\n" not in reply and time.monotonic() < deadline:
            part = s.recv(4096)
            if not part:
                break
            reply += part
    assert reply.startswith(b"HTTP/1.1 408"), reply[:100]


async def test_clients_vanishing_mid_stream_leave_the_gateway_serving(gw):
    body = {"model": "m1", "prompt": "x", "max_tokens": 200, "stream": True}
    headers = {"Authorization": f"Bearer {gw.key}"}
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(20):
            async with client.stream("POST", f"{gw.url}/v1/completions", json=body, headers=headers) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    break  # hang up after the first chunk
        r = await client.post(
            f"{gw.url}/v1/completions", json={"model": "m1", "prompt": "x", "max_tokens": 2}, headers=headers
        )
        assert r.status_code == 200
    # every vanished stream released its slot
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if all(rep.outstanding == 0 for rep in gw.app.router.replicas):
            break
        await asyncio.sleep(0.05)
    assert [rep.outstanding for rep in gw.app.router.replicas] == [0]


def test_no_5xx_for_a_barrage_of_junk(gw):
    junk = [
        b"",
        b"\x00\xff" * 100,
        b'{"model": "m1", "prompt": "\\ud800"}',
        b'{"model": "' + b"m" * 5000 + b'"}',
    ]
    junk += [json.dumps(b).encode() if not isinstance(b, bytes) else b for b, _, _ in BAD]
    for body in junk:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
            r = _post(gw, path, body)
            assert 400 <= r.status_code < 500, (path, body[:50], r.status_code, r.text)


async def test_key_cache_stays_bounded_under_random_keys():
    from fixtures.gateway import MemoryStore

    from controlplane.gateway.auth import KeyCache, hash_key, new_key

    store = MemoryStore()
    cache = KeyCache(store, ttl=60, size=50)
    for _ in range(500):
        assert await cache.get(hash_key(new_key())) is None
    assert len(cache._entries) <= 50
