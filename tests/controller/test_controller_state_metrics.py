"""The controller's deployment and node series, set each pass from the store and the fleet; a draining
replica is left to its drain (never probed, judged or counted as capacity)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fixtures.common import free_port
from fixtures.fleets import gpu_fleet

from controlplane.controller.events import record_event
from controlplane.controller.reconcile import ControllerMetrics, Reconciler
from controlplane.spec import (
    DeploymentRecord,
    DeploymentSpec,
    EngineKind,
    Plan,
    ReplicaRecord,
    ReplicaState,
    Shard,
)
from controlplane.state import StateStore, open_store
from controlplane.state.base import NodeRecord


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    s = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    yield s
    s.close()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as c:
        yield c


def _replica(
    index: int, state: ReplicaState, endpoint: str | None, node: str, gpu: int | None
) -> ReplicaRecord:
    shards = [Shard(node=node, gpus=[gpu], pp_rank=0)] if gpu is not None else []
    return ReplicaRecord(
        id=f"web-{index}",
        deployment="web",
        index=index,
        model="web",
        engine=EngineKind.SIM,
        node=node,
        shards=shards,
        endpoint=endpoint,
        state=state,
        message="no room: 1 of 3 replica(s) could not be placed" if state is ReplicaState.PENDING else "",
        created_at=1.0,
        updated_at=1.0,
    )


async def test_deployment_and_node_series_and_a_draining_replica_left_alone(
    sim_server, store: StateStore, client: httpx.AsyncClient
) -> None:
    sim = sim_server(served_model_name="web")
    spec = DeploymentSpec(name="web", model="sarv-tiny", replicas=3, engine=EngineKind.SIM)
    store.put_deployment(DeploymentRecord(spec=spec, plan=Plan(model="sarv-tiny", deployment="web")))
    store.put_replica(_replica(0, ReplicaState.READY, sim.url, "gpu-a", 0))
    # Its engine is gone, but it is draining: the controller must not mark it unhealthy or failed.
    store.put_replica(_replica(1, ReplicaState.DRAINING, f"http://127.0.0.1:{free_port()}", "gpu-b", 1))
    store.put_replica(_replica(2, ReplicaState.PENDING, None, "", None))
    store.put_node(NodeRecord(name="gpu-b", schedulable=False, reason="drain"))
    metrics = ControllerMetrics()
    rec = Reconciler(store=store, client=client, metrics=metrics, fleet=gpu_fleet(nodes=2, gpus=2))
    for _ in range(4):  # beyond the failure threshold
        report = await rec.run_once()
        assert not report.failed_phases
    assert store.get_replica("web-1").state is ReplicaState.DRAINING  # type: ignore[union-attr]
    reg = metrics.registry

    def value(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(name, labels)

    counts = {
        s: value("sarv_deployment_replicas", deployment="web", state=s)
        for s in ("desired", "current", "ready", "loading", "pending")
    }
    assert counts == {"desired": 3, "current": 1, "ready": 1, "loading": 0, "pending": 1}
    assert value("sarv_deployment_unplaced_replicas", deployment="web", reason="no_room") == 1
    assert value("sarv_node_schedulable", node="gpu-a") == 1
    assert value("sarv_node_schedulable", node="gpu-b") == 0
    gpu = "A100-SXM4-80GB"
    assert value("sarv_node_gpus", node="gpu-a", gpu_type=gpu, state="allocated") == 1
    assert value("sarv_node_gpus", node="gpu-b", gpu_type=gpu, state="allocated") == 1
    assert value("sarv_node_gpus", node="gpu-b", gpu_type=gpu, state="free") == 1
    assert report.decisions["web"].current == 2, "the draining replica is no capacity (ready + pending)"

    record_event(store, "NoRoom", "m", deployment="web", type="Warning", source="controller", metrics=metrics)
    assert value("sarv_controller_events_total", reason="NoRoom", type="Warning") == 1
    assert store.list_events("web")[-1].source == "controller"

    # A deployment that is gone loses its series.
    store.delete_deployment("web")
    await rec.run_once()
    assert value("sarv_deployment_replicas", deployment="web", state="desired") is None
    assert value("sarv_deployment_unplaced_replicas", deployment="web", reason="no_room") is None
