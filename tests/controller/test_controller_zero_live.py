"""Scale to zero end to end: ``sim`` replicas started by ``llmctl deploy``, the real controller process, a
real gateway on the same store.

An idle deployment goes to zero (asleep with sleep mode, stopped without); a request for it is held by
the gateway, the controller wakes a replica and the request is answered 200; a burst beyond the hold queue
gets 503 with Retry-After at once and the held ones are all served; a hold past its timeout is 503; a
model nobody deploys stays 404.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fixtures.controller import controller_process, llmctl_env
from fixtures.gateway import GatewayStarter, add_key, gateway_factory
from fixtures.vllm import LlmctlEnv

from controlplane.gateway import GatewayConfig
from controlplane.gateway.config import HoldConfig, RoutingConfig
from controlplane.spec import ReplicaState, ZeroMode
from controlplane.state import StateStore, open_store

__all__ = ["gateway_factory", "llmctl_env"]  # the fixtures, imported for this module

_CONFIG = "period_s: 0.5\nprobe_timeout_s: 2\n"
_MODEL = "sarv-tiny"
_BODY = {"model": _MODEL, "prompt": "hello", "max_tokens": 4}


@pytest.fixture
def store(llmctl_env: LlmctlEnv) -> Iterator[StateStore]:
    s = open_store(llmctl_env.env["SARV_STATE_URL"])
    yield s
    s.close()


def until(what: str, check: Callable[[], bool], tmp_path: Path, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    log = (tmp_path / "controller.log").read_text()[-3000:]
    pytest.fail(f"{what} did not happen within {limit:.0f}s; controller log:\n{log}")


def reasons(store: StateStore) -> list[str]:
    return [e.reason for e in store.list_events(_MODEL)]


def at_zero(store: StateStore, mode: ZeroMode) -> bool:
    dep = store.get_deployment(_MODEL)
    return dep is not None and dep.zero is mode


def gateway(factory: GatewayStarter, store: StateStore, **hold: float) -> tuple[str, dict[str, str], object]:
    cfg = GatewayConfig(routing=RoutingConfig(discovery_interval_s=0.2), hold=HoldConfig(**hold))
    gw = factory(store, cfg)
    return gw.url, {"Authorization": f"Bearer {add_key(store, name=f'k{len(factory.started)}')}"}, gw


def held(gw: object, outcome: str) -> float:
    registry = gw.app.metrics.registry  # type: ignore[attr-defined]
    return registry.get_sample_value("sarv_gateway_held_total", {"model": _MODEL, "outcome": outcome}) or 0.0


async def burst(url: str, headers: dict[str, str], n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, trust_env=False) as c:
        return list(await asyncio.gather(*(c.post("/v1/completions", json=_BODY) for _ in range(n))))


def test_sleep_path_holds_wakes_serves_and_bounds_the_queue(
    llmctl_env: LlmctlEnv, store: StateStore, tmp_path: Path, gateway_factory: GatewayStarter
) -> None:
    env = llmctl_env
    env.llmctl(
        "deploy", _MODEL, "--engine", "sim", "--scale-to-zero", "--idle-timeout", "2",
        "--engine-arg", "enable_sleep_mode=true", "--engine-arg", "wake_s=1",
        check=True,
    )  # fmt: skip
    url, headers, gw = gateway(gateway_factory, store, max_held_per_model=2)
    (before,) = store.list_replicas(_MODEL)
    with controller_process(env, tmp_path, _CONFIG):
        until("scale to zero", lambda: at_zero(store, ZeroMode.SLEEP), tmp_path)
        until("the replica asleep", lambda: "ScaledToZero" in reasons(store), tmp_path)
        assert store.list_replicas(_MODEL)[0].state is ReplicaState.SLEEPING
        assert httpx.get(f"{before.endpoint}/is_sleeping", timeout=5).json() == {"is_sleeping": True}
        unknown = httpx.post(f"{url}/v1/completions", headers=headers, json={**_BODY, "model": "nope"})
        assert unknown.status_code == 404, unknown.text

        answers = asyncio.run(burst(url, headers, 5))
        codes = sorted(r.status_code for r in answers)
        assert codes == [200, 200, 503, 503, 503], [r.text for r in answers]
        for r in answers:
            if r.status_code == 503:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["code"] == "model_waking"
        assert held(gw, "served") == 2 and held(gw, "full") == 3, "every held request was served"
        (after,) = store.list_replicas(_MODEL)
        assert after.state is ReplicaState.READY
        assert after.id == before.id and after.handle == before.handle, "woken, not started again"
        assert "ScaledToZero" in reasons(store) and "Woken" in reasons(store)
        zeroed = next(e for e in store.list_events(_MODEL) if e.reason == "ScaledToZero")
        assert "asleep (sleep mode level 1" in zeroed.message
        dep = store.get_deployment(_MODEL)
        assert dep is not None and dep.zero is None


def test_stop_path_cold_starts_and_a_hold_past_its_timeout_is_503(
    llmctl_env: LlmctlEnv, store: StateStore, tmp_path: Path, gateway_factory: GatewayStarter
) -> None:
    env = llmctl_env
    env.llmctl("deploy", _MODEL, "--engine", "sim", "--scale-to-zero", "--idle-timeout", "2", check=True)
    url, headers, gw = gateway(gateway_factory, store, hold_timeout_s=30)
    short_url, short_headers, short_gw = gateway(gateway_factory, store, hold_timeout_s=1)
    with controller_process(env, tmp_path, _CONFIG):
        gone = lambda: at_zero(store, ZeroMode.STOP) and not store.list_replicas(_MODEL)  # noqa: E731
        until("scale to zero", gone, tmp_path)
    stopped = [e for e in store.list_events(_MODEL) if e.reason == "ScaledToZero"]
    assert stopped and "stopped (no sleep mode" in stopped[0].message

    # No controller: nothing wakes it, the hold runs out.
    late = httpx.post(f"{short_url}/v1/completions", headers=short_headers, json=_BODY, timeout=30)
    assert late.status_code == 503, late.text
    assert int(late.headers["retry-after"]) >= 1
    assert held(short_gw, "timeout") == 1
    assert _MODEL in store.list_wake_requests(), "the gateway asked to wake it"

    with controller_process(env, tmp_path, _CONFIG):
        answer = httpx.post(f"{url}/v1/completions", headers=headers, json=_BODY, timeout=60)
        assert answer.status_code == 200, answer.text
        assert held(gw, "served") == 1
        assert "Woken" in reasons(store)
        (rec,) = store.list_replicas(_MODEL)
        assert rec.state is ReplicaState.READY
