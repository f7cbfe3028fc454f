"""Drain with a stream in flight through a real gateway: the stream finishes on the draining replica,
new requests go to the others, and the replica stops once it is idle."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
from fixtures.fleets import gpu_fleet
from fixtures.gateway import GatewayStarter, add_key, wait_for

from controlplane.controller.scaling import NodeDrainResult, drain_node
from controlplane.spec import DeploymentSpec, EngineKind, ReplicaState

_TOKENS = 300
"""At 50 ms a token the stream outlasts starting the replacement and the drain's settle time."""


def test_a_drained_nodes_stream_finishes_and_new_requests_go_elsewhere(sim_deployer) -> None:
    d = sim_deployer(gpu_fleet(nodes=3, gpus=1))
    spec = DeploymentSpec(
        name="web", model="sarv-tiny", engine=EngineKind.SIM, replicas=2, engine_args={"itl_ms": 50}
    )
    d.deploy(spec, timeout=120)
    with contextlib.ExitStack() as stack:
        starter = GatewayStarter()
        stack.callback(starter.close)
        gw = starter(d.store)
        key = add_key(d.store)
        headers = {"Authorization": f"Bearer {key}"}
        client = stack.enter_context(httpx.Client(base_url=gw.url, headers=headers, timeout=60))
        body = {"model": "web", "prompt": "hello", "max_tokens": _TOKENS, "ignore_eos": True}
        wait_for(lambda: client.post("/v1/completions", json={**body, "max_tokens": 1}).status_code == 200)

        chunks: list[str] = []
        served_by: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                served_by.append(resp.headers["x-sarv-replica"])
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])
                        first.set()

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert first.wait(30)
        rec = d.store.get_replica(served_by[0])
        assert rec is not None

        outcome: list[NodeDrainResult] = []
        drainer = threading.Thread(target=lambda: outcome.append(drain_node(d, rec.node, timeout=60)))
        drainer.start()

        def draining() -> bool:
            now = d.store.get_replica(rec.id)
            return now is not None and now.state is ReplicaState.DRAINING

        wait_for(draining, timeout=60)
        assert streamer.is_alive(), "the stream is still in flight while its replica drains"
        time.sleep(1.0)  # the gateway's discovery re-reads the store every 0.5 s
        others = set()
        for _ in range(6):
            resp = client.post("/v1/completions", json={**body, "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            others.add(resp.headers["x-sarv-replica"])
        assert rec.id not in others, "no new request reaches the draining replica"
        assert d.store.get_replica(rec.id) is not None, "not stopped while its stream runs"

        streamer.join(60)
        drainer.join(60)
        assert not streamer.is_alive() and not drainer.is_alive()
        assert chunks[-1] == "[DONE]"
        texts = [json.loads(c)["choices"][0] for c in chunks[:-1]]
        assert texts[-1]["finish_reason"] == "length"
        assert all("error" not in c for c in chunks)
        [result] = outcome
        assert [o.replica for o in result.drained] == [rec.id]
        assert len(result.replaced["web"]) == 1
        assert not result.drained[0].timed_out, "stopped once the stream finished, not at the timeout"
        assert d.store.get_replica(rec.id) is None
