"""``scale`` in place with real parts: sim replicas (local processes) on a declared three-node GPU fleet,
the real planner and a SQLite store."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.catalog import Catalog
from controlplane.controller import Deployer, default_engines
from controlplane.controller.scaling import raise_unplaced, scale
from controlplane.errors import PlacementError
from controlplane.launchers import is_local_node, launcher_for
from controlplane.placement import place
from controlplane.settings import Settings
from controlplane.spec import GPU, DeploymentSpec, EngineKind, Fleet, Node, ReplicaState
from controlplane.state import open_store


def _fleet(nodes: int = 3, gpus: int = 2) -> Fleet:
    return Fleet(
        nodes=[
            Node(
                name=f"gpu-{chr(97 + n)}",
                address="127.0.0.1",
                gpus=[GPU(index=i, model="A100-SXM4-80GB", memory_total_mib=81920) for i in range(gpus)],
            )
            for n in range(nodes)
        ]
    )


@pytest.fixture
def make_deployer(tmp_path: Path) -> Iterator[functools.partial[Deployer]]:
    settings = Settings(home=tmp_path / "home")
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}", settings)
    made: list[Deployer] = []

    def make(fleet: Fleet) -> Deployer:
        d = Deployer(
            settings=settings,
            store=store,
            fleet=fleet,
            catalog=Catalog.load(settings.catalog),
            planner=functools.partial(place, is_local=is_local_node, local_cpus=os.cpu_count()),
            launcher_factory=lambda node: launcher_for(node, settings.home, settings.resolved_model_cache),
            engines=default_engines(settings),
            python=sys.executable,
        )
        made.append(d)
        return d

    yield functools.partial(make)
    for d in made[:1]:
        for dep in d.store.list_deployments():
            d.undeploy(dep.name)
    store.close()


def _spec(replicas: int = 1) -> DeploymentSpec:
    return DeploymentSpec(name="web", model="sarv-tiny", engine=EngineKind.SIM, replicas=replicas)


def test_scale_up_places_new_replicas_on_other_nodes_and_down_removes_them(make_deployer) -> None:
    d = make_deployer(_fleet())
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

    down = scale(d, "web", 2, reason="test", drain_timeout=10)
    assert down.removed == ["web-2"], "all idle: the youngest goes"
    assert sorted(r.id for r in d.store.list_replicas("web")) == ["web-0", "web-1"]
    reasons = [e.reason for e in d.store.list_events("web")]
    assert reasons == ["Scaled", "Drained", "Stopped", "ScaledDown"]


def test_a_scale_that_does_not_fit_adds_what_fits_and_records_the_rest_pending(make_deployer) -> None:
    d = make_deployer(_fleet(nodes=1, gpus=2))
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
