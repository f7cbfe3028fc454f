"""The other routes a replica serves, through the gateway to a simulator replica: responses, rerank, score,
tokenize, audio. Same key, model and limit checks, routing and metrics as chat; the official ``openai``
client where it has methods for them."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import pytest
from fixtures.common import http_server
from fixtures.gateway import add_key, add_replica, make_store
from pydantic import SecretStr

from controlplane._multipart import boundary, form_fields

_WAV = b"RIFF" + b"\x00" * 60  # the simulator reads only the file's length


@pytest.fixture
def gw(tmp_path, sim_server, gateway_factory, monkeypatch):
    """A gateway in front of one simulator replica of "m1" that requires its engine key on /v1/*."""
    monkeypatch.setenv("VLLM_API_KEY", "engine-secret-pt")
    sim = sim_server(served_model_name="m1", latency_mode="fixed", fixed_output_tokens=6)
    monkeypatch.delenv("VLLM_API_KEY")
    store = make_store(tmp_path)
    store.put_engine_key("m1", SecretStr("engine-secret-pt"))
    add_replica(store, sim.url, "m1", rid="m1-0")
    key = add_key(store, "alice")
    other = add_key(store, "bob", models=["other"])
    limited = add_key(store, "carol", rpm=2)
    gateway = gateway_factory(store)
    return gateway, {"alice": key, "bob": other, "carol": limited}, sim


@pytest.fixture
def oai(gw) -> Iterator[Any]:
    """The official client, with alice's key, against the gateway."""
    import openai

    gateway, keys, _ = gw
    with openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key=keys["alice"], max_retries=0, timeout=30
    ) as client:
        yield client


def _post(gw, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", headers={"Authorization": f"Bearer {key}"}, json=body, timeout=30)


def test_responses_with_the_openai_client_sync_async_and_streamed(gw, oai) -> None:
    import openai

    gateway, keys, _ = gw
    client = oai
    resp = client.responses.create(model="m1", input="Say hello.", max_output_tokens=8)
    assert resp.status == "completed" and resp.output_text
    assert resp.usage is not None and resp.usage.output_tokens == 6
    with client.responses.stream(model="m1", input=[{"role": "user", "content": "hi"}]) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) == 6 and "".join(deltas) == final.output_text

    async def run() -> str:
        aclient = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=keys["alice"], max_retries=0)
        try:
            return (await aclient.responses.create(model="m1", input="hi")).output_text
        finally:
            await aclient.close()

    assert asyncio.run(run())
    text = httpx.get(gateway.metrics_url).text
    assert 'sarv_gateway_requests_total{key="alice",model="m1",status="200",team=""} 3.0' in text
    # the Responses API's own usage names (input/output tokens) reach the token counters
    assert 'sarv_gateway_completion_tokens_total{key="alice",model="m1",team=""} 18.0' in text


def test_audio_transcription_with_the_openai_client_and_translation(gw, oai) -> None:
    import openai

    gateway, keys, _ = gw
    client = oai
    out = client.audio.transcriptions.create(model="m1", file=("a.wav", io.BytesIO(_WAV), "audio/wav"))
    assert out.text
    # The client marks translations deprecated: the same form, sent with httpx.
    text = httpx.post(
        f"{gateway.url}/v1/audio/translations",
        headers={"Authorization": f"Bearer {keys['alice']}"},
        files={"file": ("a.wav", _WAV, "audio/wav")},
        data={"model": "m1", "response_format": "text"},
        timeout=30,
    )
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    assert text.text.strip()
    with pytest.raises(openai.NotFoundError) as info:
        client.audio.transcriptions.create(model="nope", file=("a.wav", io.BytesIO(_WAV), "audio/wav"))
    assert "/v1/audio/transcriptions" in str(info.value) and "'nope'" in str(info.value)


@pytest.mark.parametrize(
    ("path", "body", "check"),
    [
        ("/v1/rerank", {"model": "m1", "query": "q", "documents": ["a", "b", "c"], "top_n": 2}, "results"),
        ("/rerank", {"model": "m1", "query": "q", "documents": ["a"]}, "results"),
        ("/v1/score", {"model": "m1", "text_1": "q", "text_2": ["a", "b"]}, "data"),
        ("/score", {"model": "m1", "text_1": ["q"], "text_2": ["a"]}, "data"),
        ("/tokenize", {"model": "m1", "prompt": "hello there world"}, "tokens"),
        ("/detokenize", {"model": "m1", "tokens": [1, 2, 3]}, "prompt"),
    ],
)
def test_json_pass_through_routes(gw, path, body, check) -> None:
    gateway, keys, _ = gw
    r = _post(gateway, keys["alice"], path, body)
    assert r.status_code == 200, r.text
    assert check in r.json()
    assert r.headers["x-sarv-replica"] == "m1-0" and r.headers["x-request-id"]
    if path == "/v1/rerank":
        assert len(r.json()["results"]) == 2


def test_pass_through_refusals_are_the_gateways_own(gw) -> None:
    gateway, keys, _ = gw
    body = {"model": "m1", "query": "q", "documents": ["a"]}
    assert httpx.post(f"{gateway.url}/v1/rerank", json=body).status_code == 401
    denied = _post(gateway, keys["bob"], "/v1/rerank", body)
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "model_not_allowed"
    missing = _post(gateway, keys["alice"], "/v1/score", {"model": "ghost", "text_1": "a", "text_2": "b"})
    err = missing.json()["error"]
    assert missing.status_code == 404 and "/v1/score" in err["message"] and "'ghost'" in err["message"]
    no_model = _post(gateway, keys["alice"], "/tokenize", {"prompt": "x"})
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    assert (
        httpx.get(
            f"{gateway.url}/v1/rerank", headers={"Authorization": f"Bearer {keys['alice']}"}
        ).status_code
        == 405
    )
    big = _post(
        gateway, keys["alice"], "/v1/responses", {"model": "m1", "input": "x", "max_output_tokens": 10**6}
    )
    assert big.status_code == 400 and big.json()["error"]["param"] == "max_output_tokens"
    # audio needs a form: a JSON body is refused before any replica sees it; a form without a model too
    wrong = _post(gateway, keys["alice"], "/v1/audio/transcriptions", {"model": "m1"})
    assert wrong.status_code == 415 and wrong.json()["error"]["code"] == "unsupported_media_type"
    form = httpx.post(
        f"{gateway.url}/v1/audio/transcriptions",
        headers={"Authorization": f"Bearer {keys['alice']}"},
        files={"file": ("a.wav", _WAV, "audio/wav")},
        timeout=30,
    )
    assert form.status_code == 400 and form.json()["error"]["param"] == "model"
    # the key's request limit counts these routes like any other
    codes = [
        _post(gateway, keys["carol"], "/tokenize", {"model": "m1", "prompt": "x"}).status_code
        for _ in range(3)
    ]
    assert codes == [200, 200, 429]


class _NoRoutes(BaseHTTPRequestHandler):
    """A replica that serves its model list only (as a vLLM generate model has no /v1/rerank)."""

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "m2", "object": "model", "max_model_len": 512}]})
        self._send(200, body.encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send(404, b'{"detail":"Not Found"}')

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def bare_replica() -> Iterator[str]:
    with http_server(_NoRoutes) as port:
        yield f"http://127.0.0.1:{port}"


def test_a_replica_without_the_route_is_a_404_naming_the_path(
    tmp_path, gateway_factory, bare_replica
) -> None:
    store = make_store(tmp_path)
    add_replica(store, bare_replica, "m2", rid="m2-0")
    key = add_key(store, "alice")
    gateway = gateway_factory(store)
    r = _post(gateway, key, "/v1/rerank", {"model": "m2", "query": "q", "documents": ["a"]})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "the model's replicas do not serve /v1/rerank"


def test_form_fields_reads_named_parts_only() -> None:
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="model.wav"\r\n'
        b"Content-Type: audio/wav\r\n\r\n" + b'name="model"\r\n--Xy' + b"\r\n"
        b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="stream"\r\n\r\n\xff\xfe\r\n'
        b"--XyZ--\r\n"
    )
    sep = boundary(b'multipart/form-data; boundary="XyZ"')
    assert sep == b"XyZ"
    assert form_fields(body, sep, frozenset({"model", "stream"})) == {"model": "whisper-1"}
    assert boundary(b"application/json") is None


def test_embeddings_with_the_openai_client(tmp_path, sim_server, gateway_factory) -> None:
    import openai

    sim = sim_server(served_model_name="emb", task="embed")
    store = make_store(tmp_path)
    add_replica(store, sim.url, "emb", rid="emb-0")
    gateway = gateway_factory(store)
    key = add_key(store, "e")
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=30) as client:
        out = client.embeddings.create(model="emb", input=["a", "b"])
    assert [d.index for d in out.data] == [0, 1] and len(out.data[0].embedding) > 0
