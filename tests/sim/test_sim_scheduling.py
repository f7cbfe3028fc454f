"""Queueing, prefix caching with LRU eviction, disconnects and fixed-latency mode of real sim processes."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
from fixtures.sim import SimFactory, SimProcess
from fixtures.sim import sim_metrics as metrics


def _complete(sim: SimProcess, prompt: str | list[int], max_tokens: int = 1) -> dict[str, object]:
    r = httpx.post(
        sim.url + "/v1/completions",
        json={"model": sim.model, "prompt": prompt, "max_tokens": max_tokens},
        timeout=30,
    )
    r.raise_for_status()
    usage: dict[str, object] = r.json()["usage"]
    return usage


def _cached(sim: SimProcess, prompt: list[int]) -> int:
    details = _complete(sim, prompt)["prompt_tokens_details"]
    assert isinstance(details, dict)
    return int(details["cached_tokens"])


def _wait_metric(sim: SimProcess, name: str, value: float, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = metrics(sim).get(name)
        if seen == value:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} stayed {seen}, expected {value}")


def test_second_request_waits_when_max_num_seqs_is_one(sim_server: SimFactory) -> None:
    # Tokens arrive every 50 ms for 1000 tokens: the first request holds the only slot for ~50 s, far
    # longer than the assertions below need; it is closed as soon as they are done.
    sim = sim_server(max_num_seqs=1, ttft_ms=0, itl_ms=50)
    body = {"model": "sim", "prompt": "first", "max_tokens": 1000, "stream": True}
    results: list[int] = []
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", sim.url + "/v1/completions", json=body) as first,
    ):
        lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)  # running now
        second = threading.Thread(target=lambda: results.append(len(str(_complete(sim, "second", 2)))))
        second.start()
        _wait_metric(sim, "vllm:num_requests_waiting", 1)
        snapshot = metrics(sim)
        assert snapshot["vllm:num_requests_running"] == 1
        assert results == []  # the queued request has not been answered
    # Closing the first stream aborts it, which hands its slot to the queued request.
    second.join(timeout=30)
    assert results, "queued request never completed"
    after = metrics(sim)
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:request_success_total{finished_reason=abort}"] == 1
    assert after["vllm:request_queue_time_seconds_count"] == 2


def test_disconnect_while_queued_frees_the_queue(sim_server: SimFactory) -> None:
    sim = sim_server(max_num_seqs=1, ttft_ms=0, itl_ms=50)
    body = {"model": "sim", "prompt": "p", "max_tokens": 1000, "stream": True}
    with httpx.Client(timeout=60) as c1, c1.stream("POST", sim.url + "/v1/completions", json=body) as first:
        lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        # A raw socket, because an HTTP client would block until the queued request's headers arrive.
        payload = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", sim.port), timeout=10) as raw:
            raw.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            _wait_metric(sim, "vllm:num_requests_waiting", 1)
        _wait_metric(sim, "vllm:num_requests_waiting", 0)
        assert metrics(sim)["vllm:num_requests_running"] == 1
    _wait_metric(sim, "vllm:num_requests_running", 0)
    assert _complete(sim, "after", 1)["completion_tokens"] == 1
    assert metrics(sim)["vllm:request_success_total{finished_reason=abort}"] == 2


def test_repeated_prefix_hits_the_cache(sim_server: SimFactory) -> None:
    sim = sim_server(ttft_ms=0, itl_ms=0)
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks are cacheable ((100 - 1) // 16)
    assert _cached(sim, prompt) == 0
    assert _cached(sim, prompt) == 96
    # Same first 64 tokens, different tail: the shared full blocks hit, nothing after the divergence.
    assert _cached(sim, [*prompt[:64], *range(5000, 5036)]) == 64
    m = metrics(sim)
    assert m["vllm:prefix_cache_queries_total"] == 300
    assert m["vllm:prefix_cache_hits_total"] == 160


def test_prefix_cache_disabled(sim_server: SimFactory) -> None:
    sim = sim_server(ttft_ms=0, itl_ms=0, enable_prefix_caching=False)
    prompt = list(range(100))
    _complete(sim, prompt)
    assert _cached(sim, prompt) == 0
    assert metrics(sim)["vllm:prefix_cache_hits_total"] == 0


def test_lru_eviction_at_capacity(sim_server: SimFactory) -> None:
    # 16 blocks of 16 tokens. Each 80-token prompt + 1 output token takes 6 blocks while running and
    # leaves its 4 full prompt blocks cached; so three prompts fill 12 blocks and a fourth must evict.
    sim = sim_server(ttft_ms=0, itl_ms=0, kv_cache_tokens=256, max_model_len=256)
    a, b, c, d = (list(range(base, base + 80)) for base in (10_000, 20_000, 30_000, 40_000))
    for p in (a, b, c):
        assert _cached(sim, p) == 0
    assert _cached(sim, a) == 64  # touching A makes B the least recently used
    assert _cached(sim, d) == 0  # needs 6 blocks with 4 free: evicts B's last two blocks
    assert _cached(sim, a) == 64  # A survived: LRU, not FIFO
    assert _cached(sim, b) == 32  # B lost its tail, kept its head (tail-first eviction)


def test_kv_usage_reflects_running_requests(sim_server: SimFactory) -> None:
    sim = sim_server(ttft_ms=0, itl_ms=500, kv_cache_tokens=1024, max_model_len=512)
    body = {"model": "sim", "prompt": list(range(200)), "max_tokens": 56, "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", sim.url + "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        assert metrics(sim)["vllm:kv_cache_usage_perc"] == 16 / 64  # (200 + 56) / 16 blocks of 64
    _wait_metric(sim, "vllm:kv_cache_usage_perc", 0.0)


def test_fixed_latency_mode_sends_fixed_chunks(sim_server: SimFactory) -> None:
    sim = sim_server(latency_mode="fixed", fixed_ttft_ms=1, fixed_itl_ms=1, fixed_output_tokens=9)
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="sim", prompt="hi", max_tokens=2, stream=True)
    assert len([c for c in stream if c.choices]) == 9
    out = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])
    assert out.usage is not None and out.usage.completion_tokens == 9


def test_request_waits_for_kv_capacity(sim_server: SimFactory) -> None:
    # 16 blocks; the running request reserves 13 ((150 + 50) / 16 rounded up), the next needs 7: it
    # waits although max_num_seqs would admit it. Tokens 500 ms apart hold the blocks for ~25 s.
    sim = sim_server(
        ttft_ms=0, itl_ms=500, kv_cache_tokens=256, max_model_len=256, enable_prefix_caching=False
    )
    body = {"model": "sim", "prompt": list(range(150)), "max_tokens": 50, "stream": True}
    results: list[object] = []
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", sim.url + "/v1/completions", json=body) as first,
    ):
        lines = first.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        second = threading.Thread(target=lambda: results.append(_complete(sim, list(range(99)), 1)))
        second.start()
        _wait_metric(sim, "vllm:num_requests_waiting", 1)
        assert metrics(sim)["vllm:num_requests_running"] == 1
    second.join(timeout=30)
    assert len(results) == 1
