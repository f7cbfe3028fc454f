"""OpenAI's request and error contract at the gateway: optional fields and nulls, tool schemas, replica
errors in OpenAI's shape, ``X-Request-Id`` and W3C trace context passed to the replica."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any, ClassVar

import httpx
import openai
import pytest
from fixtures.common import http_server
from fixtures.gateway import add_key, add_replica, make_store

_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
_MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def live(tmp_path_factory, module_sims, module_gateways):
    sim = module_sims(
        served_model_name="m1", latency_mode="fixed", fixed_ttft_ms=1, fixed_itl_ms=1, fixed_output_tokens=4
    )
    store = make_store(tmp_path_factory.mktemp("st"))
    add_replica(store, sim.url, "m1", rid="m1-0")
    key = add_key(store, "compat")
    return module_gateways(store), key


def _post(live: Any, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    gw, key = live
    return httpx.post(
        f"{gw.url}{path}", json=body, headers={"Authorization": f"Bearer {key}", **headers}, timeout=30
    )


def test_null_for_every_optional_field_and_the_documented_options_are_accepted(live):
    body = {
        "model": "m1",
        "messages": _MSG,
        "max_tokens": 4,
        **dict.fromkeys(
            [
                "temperature", "top_p", "stop", "seed", "user", "n", "stream", "stream_options",
                "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "max_completion_tokens",
                "tools", "tool_choice", "parallel_tool_calls", "response_format", "logit_bias",
                "service_tier", "metadata", "store", "modalities", "reasoning_effort",
            ]
        ),
    }  # fmt: skip
    r = _post(live, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    r = _post(
        live,
        "/v1/chat/completions",
        {
            "model": "m1",
            "messages": _MSG,
            "max_tokens": 4,
            "tools": [_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
            "response_format": {"type": "json_object"},
            "logit_bias": {"42": -100},
            "metadata": {"team": "a"},
        },
    )
    assert r.status_code == 200, r.text
    r = _post(live, "/v1/completions", {"model": "m1", "prompt": "x", "max_tokens": 2, "logit_bias": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "tools.0.function.parameters"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "no"}}}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"logit_bias": {"42": "high"}}, "logit_bias.42"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)  # fmt: skip
def test_malformed_tools_and_options_are_openai_400s(live, extra, param):
    r = _post(live, "/v1/chat/completions", {"model": "m1", "messages": _MSG, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["code"] == "invalid_value"


def test_a_replica_refusal_reaches_the_client_in_openai_shape_with_its_status(live):
    # The simulator refuses echo as vLLM does: {"error": {"type": "BadRequestError", "code": 400, ...}}.
    r = _post(live, "/v1/completions", {"model": "m1", "prompt": "x", "max_tokens": 2, "echo": True})
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == "echo"
    assert "echo" in err["message"]
    assert err["code"] is None or isinstance(err["code"], str)
    gw, key = live
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="m1", prompt="x", max_tokens=2, echo=True)
    assert bad.value.param == "echo"
    assert bad.value.type == "invalid_request_error"


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict[str, str]]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(b'{"object":"list","data":[]}' if self.path.startswith("/v1") else b"")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.seen.append({k.lower(): v for k, v in self.headers.items()})
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "rec",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        self._answer(json.dumps(answer).encode())


@pytest.fixture
def recorded(tmp_path, gateway_factory) -> Iterator[tuple[Any, str]]:
    with http_server(_Recorder) as port:
        store = make_store(tmp_path)
        add_replica(store, f"http://127.0.0.1:{port}", "rec", rid="rec-0")
        key = add_key(store, "trace")
        _Recorder.seen.clear()
        yield gateway_factory(store), key


_PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_request_id_and_trace_context_reach_the_replica_and_the_id_comes_back(recorded):
    body = {"model": "rec", "messages": _MSG}
    r = _post(recorded, "/v1/chat/completions", body, **{"X-Request-Id": "req-42.a", "traceparent": _PARENT,
                                                         "tracestate": "vendor=abc"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "req-42.a"
    seen = _Recorder.seen[-1]
    assert seen["x-request-id"] == "req-42.a"
    assert seen["traceparent"] == _PARENT
    assert seen["tracestate"] == "vendor=abc"
    # Invalid ones: the id is replaced by a generated one, an invalid traceparent is not forwarded.
    r = _post(recorded, "/v1/chat/completions", body, **{"X-Request-Id": "x" * 300, "traceparent": "00-zz",
                                                         "tracestate": "vendor=abc"})  # fmt: skip
    assert r.status_code == 200
    generated = r.headers["x-request-id"]
    assert len(generated) == 32
    seen = _Recorder.seen[-1]
    assert seen["x-request-id"] == generated
    assert "traceparent" not in seen
    assert "tracestate" not in seen
    # No id given: one is generated per request, and the gateway's own refusals carry it too.
    a = _post(recorded, "/v1/chat/completions", body).headers["x-request-id"]
    b = _post(recorded, "/v1/chat/completions", body).headers["x-request-id"]
    assert a != b
    refused = _post(
        recorded, "/v1/chat/completions", {"model": "rec", "messages": []}, **{"X-Request-Id": "r1"}
    )
    assert refused.status_code == 400
    assert refused.headers["x-request-id"] == "r1"


def test_one_model_card_by_id_and_a_404_naming_an_unknown_one(live):
    gw, key = live
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.get(f"{gw.url}/v1/models/m1", headers=auth)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "m1"
    assert r.json()["object"] == "model"
    r = httpx.get(f"{gw.url}/v1/models/nope", headers=auth)
    assert r.status_code == 404
    assert "'nope'" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{gw.url}/v1/models/m1").status_code == 401
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    assert client.models.retrieve("m1").id == "m1"
