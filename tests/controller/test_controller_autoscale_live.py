"""Autoscaling end to end in real time: ``sim`` replicas behind a real gateway, the real controller process.

A bounded load step through the gateway grows the deployment; once the load stops it shrinks back; no
request fails on the way. The controller's windows and delays are shortened by its config file only.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fixtures.controller import controller_process, llmctl_env
from fixtures.gateway import GatewayStarter, add_key, gateway_factory
from fixtures.vllm import LlmctlEnv

from controlplane.gateway import GatewayConfig
from controlplane.gateway.config import RoutingConfig
from controlplane.state import StateStore, open_store

__all__ = ["gateway_factory", "llmctl_env"]  # the fixtures, imported for this module

_LOAD_LIMIT_S = 60.0
"""Most seconds the load step runs: it stops early once the deployment has grown."""
_CLIENTS = 4


@pytest.fixture
def store(llmctl_env: LlmctlEnv) -> Iterator[StateStore]:
    s = open_store(llmctl_env.env["SARV_STATE_URL"])
    yield s
    s.close()


def ready(store: StateStore) -> int:
    return sum(1 for r in store.list_replicas("sarv-tiny") if r.state.value == "ready")


async def load_step(url: str, key: str, store: StateStore) -> Counter[int]:
    """``_CLIENTS`` clients, one request after another each, until the deployment has 2 ready replicas
    and they have sent a little more, or ``_LOAD_LIMIT_S``. Returns the count of each status code."""
    codes: Counter[int] = Counter()
    deadline = time.monotonic() + _LOAD_LIMIT_S
    grown_at: list[float] = []
    body = {"model": "sarv-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}

    async def client(c: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline and not (grown_at and time.monotonic() > grown_at[0] + 2.0):
            resp = await c.post(f"{url}/v1/chat/completions", json=body)
            codes[resp.status_code] += 1

    async def watch() -> None:
        while time.monotonic() < deadline and not grown_at:
            if await asyncio.to_thread(ready, store) >= 2:
                grown_at.append(time.monotonic())
            await asyncio.sleep(0.3)

    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=30.0, headers=headers, trust_env=False) as c:
        await asyncio.gather(watch(), *(client(c) for _ in range(_CLIENTS)))
    return codes


def test_load_step_grows_the_deployment_and_it_shrinks_after(
    llmctl_env: LlmctlEnv, store: StateStore, tmp_path: Path, gateway_factory: GatewayStarter
) -> None:
    env = llmctl_env
    # One sequence at a time and ~0.2 s per answer: 4 clients queue ~0.6 s in the engine.
    env.llmctl(
        "deploy", "sarv-tiny", "--engine", "sim", "--min-replicas", "1", "--max-replicas", "2",
        "--engine-arg", "max_num_seqs=1", "--engine-arg", "latency_mode=fixed",
        "--engine-arg", "fixed_itl_ms=10", "--engine-arg", "fixed_output_tokens=16",
        check=True,
    )  # fmt: skip
    key = add_key(store)
    gw = gateway_factory(store, GatewayConfig(routing=RoutingConfig(discovery_interval_s=0.2)))
    config = f"""\
period_s: 0.5
gateway_metrics: ["{gw.url}/metrics"]
drain_timeout_s: 10
autoscale:
  window_s: 3
  target_ongoing_requests: 1
  load_upscale_delay_s: 0
  downscale_delay_s: 3
"""
    with controller_process(env, tmp_path, config):
        codes = asyncio.run(load_step(gw.url, key, store))
        grew = ready(store)
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and len(store.list_replicas("sarv-tiny")) > 1:
            time.sleep(0.3)
        left = store.list_replicas("sarv-tiny")
    log = (tmp_path / "controller.log").read_text()[-3000:]
    assert grew == 2, log
    assert set(codes) == {200}, codes
    assert sum(codes.values()) > _CLIENTS
    assert [r.state.value for r in left] == ["ready"], log
    record = store.get_deployment("sarv-tiny")
    assert record is not None
    assert record.spec.replicas == 1
    events = [e for e in store.list_events("sarv-tiny") if e.source == "controller"]
    up = [e for e in events if e.reason == "Scaled"]
    down = [e for e in events if e.reason == "ScaledDown"]
    assert up, events
    assert down, events
    assert "scaled from 1 to 2:" in up[0].message
    assert "wait p90" in up[0].message or "requests per replica" in up[0].message
    assert "requests per replica < target 1" in down[0].message
