"""vLLM's sleep mode in the simulator: /sleep, /wake_up and /is_sleeping (dev mode only, as vLLM), requests
held while asleep and served after the wake-up, and vLLM's engine_sleep_state gauge."""

from __future__ import annotations

import threading

import httpx
import pytest
from fixtures.sim import SimFactory, sim_metrics


def _complete(url: str, out: list[httpx.Response]) -> None:
    out.append(
        httpx.post(
            f"{url}/v1/completions", json={"model": "sim", "prompt": "hi", "max_tokens": 2}, timeout=60
        )
    )


def test_sleep_holds_requests_until_the_wake_up(
    sim_server: SimFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    sim = sim_server(enable_sleep_mode=True, sleep_s=0.05, wake_s=0.3)
    assert httpx.get(f"{sim.url}/is_sleeping").json() == {"is_sleeping": False}
    assert sim_metrics(sim)["vllm:engine_sleep_state{sleep_state=awake}"] == 1

    slept = httpx.post(f"{sim.url}/sleep", params={"level": 1}, timeout=10)
    assert slept.status_code == 200 and slept.json() == {"status": "sleeping", "level": 1}
    assert httpx.get(f"{sim.url}/is_sleeping").json() == {"is_sleeping": True}
    metrics = sim_metrics(sim)
    assert metrics["vllm:engine_sleep_state{sleep_state=weights_offloaded}"] == 1
    assert metrics["vllm:engine_sleep_state{sleep_state=awake}"] == 0
    assert httpx.get(f"{sim.url}/v1/models").status_code == 200  # the server itself still answers

    held: list[httpx.Response] = []
    thread = threading.Thread(target=_complete, args=(sim.url, held))
    thread.start()
    thread.join(timeout=1.0)
    assert thread.is_alive() and not held, "a request to a sleeping engine is held, not answered"
    woke = httpx.post(f"{sim.url}/wake_up", timeout=10)
    assert woke.json() == {"status": "awake", "tags": None}
    thread.join(timeout=30)
    assert [r.status_code for r in held] == [200]
    assert httpx.get(f"{sim.url}/is_sleeping").json() == {"is_sleeping": False}
    assert sim_metrics(sim)["vllm:engine_sleep_state{sleep_state=awake}"] == 1


def test_level_2_discards_the_weights(sim_server: SimFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    sim = sim_server(enable_sleep_mode=True, sleep_s=0, wake_level2_s=0.1)
    assert httpx.post(f"{sim.url}/sleep", params={"level": 2}).json()["level"] == 2
    assert sim_metrics(sim)["vllm:engine_sleep_state{sleep_state=discard_all}"] == 1
    assert httpx.post(f"{sim.url}/sleep", params={"level": 7}).status_code == 400
    httpx.post(f"{sim.url}/wake_up", timeout=10)
    out: list[httpx.Response] = []
    _complete(sim.url, out)
    assert out[0].status_code == 200


def test_sleep_needs_dev_mode_and_the_flag(sim_server: SimFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    plain = sim_server(enable_sleep_mode=True)
    assert httpx.post(f"{plain.url}/sleep").status_code == 404  # as vLLM: no dev routes without dev mode
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    unflagged = sim_server()
    refused = httpx.post(f"{unflagged.url}/sleep")
    assert refused.status_code == 400 and "--enable-sleep-mode" in refused.json()["error"]["message"]
