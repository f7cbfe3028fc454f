"""Failure injection of real sim processes: 500s, hangs, crashes, slow start; and bad command lines."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest
from fixtures.sim import SimFactory
from fixtures.sim import sim_metrics as metrics


def test_failure_rate_one_answers_500(sim_server: SimFactory) -> None:
    sim = sim_server(failure_rate=1.0, ttft_ms=0, itl_ms=0)
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="sim", prompt="x", max_tokens=2)
    r = httpx.post(sim.url + "/v1/chat/completions", json={"model": "sim", "messages": [{"role": "user"}]})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError"
    assert httpx.get(sim.url + "/health").status_code == 200


def test_partial_failure_rate_is_reproducible(sim_server: SimFactory) -> None:
    outcomes = []
    for _ in range(2):
        sim = sim_server(failure_rate=0.5, seed=7, ttft_ms=0, itl_ms=0)
        codes = [
            httpx.post(
                sim.url + "/v1/completions", json={"model": "sim", "prompt": "x", "max_tokens": 1}
            ).status_code
            for _ in range(20)
        ]
        outcomes.append(codes)
        sim.stop()
    assert outcomes[0] == outcomes[1]
    assert set(outcomes[0]) == {200, 500}


def test_hang_rate_one_never_answers(sim_server: SimFactory) -> None:
    sim = sim_server(hang_rate=1.0, ttft_ms=0, itl_ms=0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            sim.url + "/v1/completions", json={"model": "sim", "prompt": "x", "max_tokens": 1}, timeout=1.0
        )
    # The replica itself stays up and reports nothing running: the hung request holds no slot.
    assert httpx.get(sim.url + "/health").status_code == 200
    assert metrics(sim)["vllm:num_requests_running"] == 0


def test_crash_after_n_requests_exits(sim_server: SimFactory) -> None:
    sim = sim_server(crash_after=2, ttft_ms=0, itl_ms=0)
    body = {"model": "sim", "prompt": "x", "max_tokens": 1}
    assert httpx.post(sim.url + "/v1/completions", json=body).status_code == 200
    assert httpx.post(sim.url + "/v1/completions", json=body).status_code == 200
    assert sim.proc.wait(timeout=20) == 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(sim.url + "/health", timeout=2)


@pytest.mark.slow
def test_slow_start_answers_503_then_becomes_healthy(sim_server: SimFactory) -> None:
    sim = sim_server(slow_start_s=8, wait_healthy=False)
    first = httpx.get(sim.url + "/health", timeout=5)
    assert first.status_code == 503
    assert httpx.get(sim.url + "/v1/models", timeout=5).status_code == 503
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        if httpx.get(sim.url + "/health", timeout=5).status_code == 200:
            break
        time.sleep(0.2)
    else:
        pytest.fail("sim never became healthy")
    assert httpx.get(sim.url + "/v1/models", timeout=5).status_code == 200


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--max-model-len", "8192", "--kv-cache-tokens", "4096"], "kv_cache_tokens"),
        (["--failure-rate", "0.7", "--hang-rate", "0.5"], "must not exceed 1"),
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--served-model-name", "a", "--lora-modules", "a"], "unique"),
    ],
)
def test_bad_command_line_exits_2_with_one_line(args: list[str], fragment: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "controlplane.simulator", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    assert fragment in lines[0]


def test_api_key_guards_v1_only(sim_server: SimFactory) -> None:
    sim = sim_server(
        "--api-key", "k-123", "--dtype", "bfloat16", "--tensor-parallel-size", "1", "--enforce-eager"
    )
    body = {"model": "sim", "prompt": "x", "max_tokens": 1}
    assert httpx.post(sim.url + "/v1/completions", json=body).status_code == 401
    wrong = httpx.post(sim.url + "/v1/completions", json=body, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.json() == {"error": "Unauthorized"}
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="k-123", max_retries=0)
    assert client.completions.create(model="sim", prompt="x", max_tokens=1).usage is not None
    # As in vLLM, only /v1 is guarded: health checks and scrapes need no key.
    assert httpx.get(sim.url + "/health").status_code == 200
    assert httpx.get(sim.url + "/metrics").status_code == 200


def test_api_key_from_environment(sim_server: SimFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    sim = sim_server()
    assert "from-env" not in " ".join(sim.args)
    body = {"model": "sim", "prompt": "x", "max_tokens": 1}
    assert httpx.post(sim.url + "/v1/completions", json=body).status_code == 401
    ok = httpx.post(sim.url + "/v1/completions", json=body, headers={"authorization": "Bearer from-env"})
    assert ok.status_code == 200
