"""``scale``, cordon and node drain with real parts: sim replicas (local processes) on a declared
three-node GPU fleet (``fixtures.fleets``), the real planner and a SQLite store."""

from __future__ import annotations

import os
import signal

import pytest
from fixtures.fleets import gpu_fleet

from controlplane.controller.health import HealthRule
from controlplane.controller.scaling import cordon, drain_node, raise_unplaced, scale, uncordon
from controlplane.errors import NotFoundError, PlacementError
from controlplane.spec import DeploymentSpec, EngineKind, ReplicaState


def _spec(replicas: int = 1, name: str = "web") -> DeploymentSpec:
    return DeploymentSpec(name=name, model="sarv-tiny", engine=EngineKind.SIM, replicas=replicas)


def test_scale_up_places_new_replicas_on_other_nodes_and_down_removes_them(sim_deployer) -> None:
    d = sim_deployer(gpu_fleet())
    d.deploy(_spec(1), timeout=120)
    first = d.store.list_replicas("web")[0]
    result = scale(d, "web", 3, reason="test", timeout=120)
    assert (result.before, result.after, result.unplaced) == (1, 3, 0)
    assert sorted(result.added) == ["web-1", "web-2"]
    reps = {r.id: r for r in d.store.list_replicas("web")}
    assert reps["web-0"].handle == first.handle, "the running replica is left alone"
    assert {r.state for r in reps.values()} == {ReplicaState.READY}
    assert len({r.node for r in reps.values()}) == 3, "anti-affinity: one replica per node"
    assert d.store.get_deployment("web").spec.replicas == 3  # type: ignore[union-attr]
    assert scale(d, "web", 3, reason="test").changed is False, "the same count twice changes nothing"

    down = scale(d, "web", 2, reason="test", drain_timeout=10)
    assert down.removed == ["web-2"], "all idle and healthy: the youngest goes"
    assert sorted(r.id for r in d.store.list_replicas("web")) == ["web-0", "web-1"]
    reasons = [e.reason for e in d.store.list_events("web")]
    assert reasons == ["Deployed", "Scaled", "Drained", "Stopped", "ScaledDown"]


def test_scale_down_removes_the_unhealthy_replica_first(sim_deployer) -> None:
    d = sim_deployer(gpu_fleet())
    d.deploy(_spec(3), timeout=120)
    sick = d.store.get_replica("web-0")
    assert sick is not None
    pgid = int(sick.handle["pid"])
    os.killpg(pgid, signal.SIGSTOP)  # alive but answering nothing: its health check times out
    try:
        states = {o.record.id: o.record.state for o in d.observe("web", rule=HealthRule(failure_threshold=1))}
    finally:
        os.killpg(pgid, signal.SIGCONT)
    assert states["web-0"] is ReplicaState.UNHEALTHY
    result = scale(d, "web", 2, reason="test", drain_timeout=10)
    assert result.removed == ["web-0"], "the oldest, but unhealthy"


def test_a_scale_that_does_not_fit_adds_what_fits_and_records_the_rest_pending(sim_deployer) -> None:
    d = sim_deployer(gpu_fleet(nodes=1, gpus=2))
    d.deploy(_spec(1), timeout=120)
    result = scale(d, "web", 4, reason="test", timeout=120)
    assert (result.added, result.unplaced) == (["web-1"], 2)
    assert "could not be placed" in result.reason
    pending = [r for r in d.store.list_replicas("web") if r.state is ReplicaState.PENDING]
    assert sorted(r.id for r in pending) == ["web-2", "web-3"]
    assert pending[0].message.startswith("no room: ")
    with pytest.raises(PlacementError, match=r"2 of 4 replica\(s\) could not be placed .*llmctl scale web 2"):
        raise_unplaced(result)
    assert [e.reason for e in d.store.list_events("web")][-1] == "NoRoom"
    # Scaling down drops the pending replicas first, without touching the running ones.
    down = scale(d, "web", 2, reason="test")
    assert sorted(down.removed) == ["web-2", "web-3"]
    assert {r.state for r in d.store.list_replicas("web")} == {ReplicaState.READY}


def test_cordoned_nodes_get_no_new_replicas_from_deploy_or_scale(sim_deployer) -> None:
    d = sim_deployer(gpu_fleet(nodes=2, gpus=2))
    assert cordon(d, "gpu-a", reason="maintenance") is True
    assert cordon(d, "gpu-a") is False, "twice changes nothing"
    d.deploy(_spec(1), timeout=120)
    assert {r.node for r in d.store.list_replicas("web")} == {"gpu-b"}
    result = scale(d, "web", 3, reason="test", timeout=120)
    assert result.unplaced == 1, "gpu-b holds two; gpu-a is cordoned"
    assert "cordoned, not considered: gpu-a" in result.reason
    assert {r.node for r in d.store.list_replicas("web") if r.node} == {"gpu-b"}
    # Uncordoned, the pending replica is placed by the next scale (here: the same count again).
    assert uncordon(d, "gpu-a") is True
    again = scale(d, "web", 3, reason="test", timeout=120)
    assert again.unplaced == 0
    assert len(again.added) == 1
    assert sorted(r.node for r in d.store.list_replicas("web")) == ["gpu-a", "gpu-b", "gpu-b"]
    with pytest.raises(NotFoundError, match="no node named 'gpu-z'"):
        cordon(d, "gpu-z")
    kinds = [(e.reason, e.object) for e in d.store.list_events() if e.object.startswith("node/")]
    assert kinds == [("Cordoned", "node/gpu-a"), ("Uncordoned", "node/gpu-a")]


def test_drain_node_starts_replacements_elsewhere_then_stops_the_nodes_replicas(sim_deployer) -> None:
    d = sim_deployer(gpu_fleet(nodes=3, gpus=2))
    d.deploy(_spec(2), timeout=120)
    node = d.store.get_replica("web-0").node  # type: ignore[union-attr]
    result = drain_node(d, node, timeout=10, start_timeout=120)
    assert result.replaced == {"web": ["web-2"]}
    assert [o.replica for o in result.drained] == ["web-0"]
    assert not result.drained[0].timed_out
    reps = d.store.list_replicas("web")
    assert sorted(r.id for r in reps) == ["web-1", "web-2"]
    assert node not in {r.node for r in reps}
    assert {r.state for r in reps} == {ReplicaState.READY}
    assert d.store.get_node(node).schedulable is False  # type: ignore[union-attr]
    assert d.store.get_deployment("web").spec.replicas == 2  # type: ignore[union-attr]
