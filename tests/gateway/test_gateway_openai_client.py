"""The official openai client (sync and async, stream and not) through the gateway: sim and a real vLLM."""

from __future__ import annotations

import json
import os

import openai
import pytest
from fixtures.gateway import add_key, add_replica, make_store

from controlplane.gateway import GatewayConfig


def _exercise_sync(client: openai.OpenAI, model: str) -> None:
    models = {m.id for m in client.models.list()}
    assert model in models
    c = client.completions.create(model=model, prompt="Hello", max_tokens=8)
    assert c.choices[0].text is not None
    assert c.usage is not None
    assert c.usage.completion_tokens > 0
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8
    )
    assert chat.choices[0].message.role == "assistant"
    pieces = []
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count"}], max_tokens=8, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert pieces
    text_stream = client.completions.create(model=model, prompt="Once", max_tokens=8, stream=True)
    assert sum(1 for _ in text_stream) >= 1


async def _exercise_async(client: openai.AsyncOpenAI, model: str) -> None:
    c = await client.completions.create(model=model, prompt="Hello", max_tokens=8)
    assert c.choices
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count"}], max_tokens=8, stream=True
    )
    n = 0
    async for _ in stream:
        n += 1
    assert n >= 2


def _exercise_errors(client: openai.OpenAI, model: str, base_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", max_tokens=1, n=10**6)
    assert bad.value.param == "n"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="sk-sarv-wrong", max_retries=0).models.list()


@pytest.fixture
def sim_gateway(tmp_path, sim_server, gateway_factory):
    sim = sim_server(served_model_name="m1")
    store = make_store(tmp_path)
    add_replica(store, sim.url, "m1", rid="m1-0")
    key = add_key(store, "sdk")
    return gateway_factory(store), key


def test_openai_client_against_sim(sim_gateway):
    gw, key = sim_gateway
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    _exercise_sync(client, "m1")
    _exercise_errors(client, "m1", f"{gw.url}/v1")


async def test_async_openai_client_against_sim(sim_gateway):
    gw, key = sim_gateway
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0) as client:
        await _exercise_async(client, "m1")


@pytest.mark.vllm
@pytest.mark.slow
async def test_openai_client_against_real_vllm(vllm_tiny, gateway_factory):
    """The gateway finds the replica ``llmctl deploy`` recorded; the official client works through it."""
    from controlplane.settings import Settings
    from controlplane.state import open_store

    home = vllm_tiny.home
    store = open_store(vllm_tiny.env["SARV_STATE_URL"], Settings(home=home))
    key = add_key(store, f"sdk-{os.getpid()}")
    gw = gateway_factory(store, GatewayConfig())
    base = f"{gw.url}/v1"
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
    _exercise_sync(client, vllm_tiny.model)
    _exercise_errors(client, vllm_tiny.model, base)
    # the replica's real context length came through discovery: a prompt far over it is refused here
    card = json.loads(client.models.with_raw_response.list().text)["data"][0]
    assert card["max_model_len"] == 1024 or card["max_model_len"] > 0
    with pytest.raises(openai.BadRequestError) as over:
        client.completions.create(model=vllm_tiny.model, prompt="word " * 20000, max_tokens=1)
    assert over.value.code == "context_length_exceeded"
    async with openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=120) as aclient:
        await _exercise_async(aclient, vllm_tiny.model)
    # Deployed with --tools: a request with tools is accepted and answered (the random model's output
    # need not be a tool call).
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    answer = client.chat.completions.create(
        model=vllm_tiny.model,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[weather],  # type: ignore[list-item]
        tool_choice="auto",
        max_tokens=8,
    )
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    store.close()
