"""A node that stops answering: its replica moves elsewhere, and the node is a candidate again once back.

Two fleet nodes on this host, each with real local launchers and real ``sim`` processes. Cutting node
``n1`` off freezes its replica's process group (its probes time out) and makes its launcher's polls fail,
as an SSH connection to a cut-off host would.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Collection
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest

from controlplane.catalog import Catalog
from controlplane.controller import Deployer, default_engines
from controlplane.controller.healing import HealingConfig
from controlplane.controller.reconcile import ControllerConfig, Reconciler
from controlplane.engines.base import EngineLaunch
from controlplane.errors import LaunchError
from controlplane.launchers.base import ReplicaProcess
from controlplane.launchers.local import LocalLauncher
from controlplane.settings import Settings
from controlplane.spec import (
    DeploymentSpec,
    EngineKind,
    Fleet,
    ModelSpec,
    Node,
    Plan,
    ReplicaPlan,
    ReplicaRecord,
    ReplicaState,
    Shard,
)
from controlplane.state import StateStore


class CuttableLauncher(LocalLauncher):
    """A local launcher whose node can be cut off: then every call that would reach the node fails."""

    def __init__(self, home: Path, cache: Path) -> None:
        super().__init__(home, cache, host="127.0.0.1")
        self.cut = False

    def poll(self, handle: dict[str, str]) -> ReplicaProcess:
        if self.cut:
            raise LaunchError("ssh: connect to host n1: Connection timed out")
        return super().poll(handle)

    def stop(self, handle: dict[str, str], *, timeout: float = 30.0) -> None:
        if self.cut:
            raise LaunchError("ssh: connect to host n1: Connection timed out")
        super().stop(handle, timeout=timeout)

    def start(self, replica_id: str, launch: EngineLaunch) -> dict[str, str]:
        assert not self.cut, "nothing may be started on a cut-off node"
        return super().start(replica_id, launch)


def first_free(
    fleet: Fleet,
    spec: DeploymentSpec,
    model: ModelSpec,
    placed: list[Shard],
    /,
    *,
    avoid_nodes: Collection[str] = (),
) -> Plan:
    """One CPU replica per node, on the first node of ``fleet`` that holds none (none left: unplaced)."""
    used = {s.node for s in placed} | set(avoid_nodes)
    free = [n.name for n in fleet.nodes if n.name not in used]
    replicas = [
        ReplicaPlan(
            tp=1,
            pp=1,
            shards=[Shard(node=name, gpus=[], pp_rank=0)],
            per_gpu_memory_gib=0.0,
            max_concurrency=1,
        )
        for name in free[: spec.replicas]
    ]
    short = spec.replicas - len(replicas)
    return Plan(
        model=model.name,
        deployment=spec.name,
        replicas=replicas,
        unplaced=short,
        reasons=["every node holds a replica"] if short else [],
    )


def make_deployer(
    tmp_path: Path, store: StateStore, nodes: list[str]
) -> tuple[Deployer, dict[str, CuttableLauncher]]:
    settings = Settings(home=tmp_path / "home")
    launchers = {n: CuttableLauncher(settings.home, settings.resolved_model_cache) for n in nodes}
    deployer = Deployer(
        settings=settings,
        store=store,
        fleet=Fleet(nodes=[Node(name=n, address="127.0.0.1") for n in nodes]),
        catalog=Catalog.load(),
        planner=first_free,
        launcher_factory=lambda node: launchers[node.name],
        engines=default_engines(settings),
        python=sys.executable,
    )
    return deployer, launchers


async def deployed_then_cut(
    deployer: Deployer, launchers: dict[str, CuttableLauncher], store: StateStore, client: httpx.AsyncClient
) -> tuple[ReplicaRecord, Reconciler]:
    """Deploy ``m`` (one replica, on n1), let the controller see it ready, then cut n1 off."""
    deployer.deploy(DeploymentSpec(name="m", model="sarv-tiny", engine=EngineKind.SIM), timeout=60)
    (old,) = store.list_replicas("m")
    assert old.node == "n1"
    config = ControllerConfig(period_s=0.2, probe_timeout_s=0.5, healing=HealingConfig(node_grace_s=1.0))
    reconciler = Reconciler(store=store, client=client, config=config, deployer=deployer)
    await reconciler.run_once()
    launchers["n1"].cut = True
    os.killpg(int(old.handle["pid"]), signal.SIGSTOP)
    return old, reconciler


async def passes(reconciler: Reconciler, until: str, check: object, limit: int = 80) -> None:
    for _ in range(limit):
        await reconciler.run_once()
        if callable(check) and check():
            return
        await asyncio.sleep(0.2)
    pytest.fail(f"{until}: not within {limit} passes")


def group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_replica_of_a_silent_node_moves_and_the_node_comes_back_without_duplicates(
    tmp_path: Path, store: StateStore, client: httpx.AsyncClient
) -> None:
    deployer, launchers = make_deployer(tmp_path, store, ["n1", "n2"])
    old, reconciler = await deployed_then_cut(deployer, launchers, store, client)
    old_pid = int(old.handle["pid"])
    try:

        def moved() -> bool:
            rec = store.get_replica("m-0")
            return rec is not None and rec.node == "n2" and rec.state is ReplicaState.READY

        await passes(reconciler, "the replica moved to n2 and ready", moved)
        node = store.get_node("n1")
        assert node is not None
        assert not node.schedulable
        assert node.reason.startswith("lost")
        reasons = [e.reason for e in store.list_events()]
        assert "NodeLost" in reasons
        assert "Rescheduled" in reasons
        (moved_event,) = [e for e in store.list_events() if e.reason == "Rescheduled"]
        assert moved_event.message == "m-0 moved from n1 (not answering) to n2"

        # The node answers again: it takes placements, and the process left on it is stopped.
        launchers["n1"].cut = False
        os.killpg(old_pid, signal.SIGCONT)

        def back() -> bool:
            rec = store.get_node("n1")
            return rec is not None and rec.schedulable

        await passes(reconciler, "n1 a candidate again", back)
        assert "NodeBack" in [e.reason for e in store.list_events()]
        for _ in range(50):
            if not group_alive(old_pid):
                break
            await asyncio.sleep(0.2)
        assert not group_alive(old_pid)
        assert [(r.id, r.node) for r in store.list_replicas("m")] == [("m-0", "n2")]
    finally:
        launchers["n1"].cut = False
        if group_alive(old_pid):
            os.killpg(old_pid, signal.SIGCONT)
        for rec in [old, *store.list_replicas()]:
            deployer.stop_process(rec)


async def test_no_room_elsewhere_leaves_the_replica_pending_with_the_reason(
    tmp_path: Path, store: StateStore, client: httpx.AsyncClient
) -> None:
    deployer, launchers = make_deployer(tmp_path, store, ["n1"])
    old, reconciler = await deployed_then_cut(deployer, launchers, store, client)
    old_pid = int(old.handle["pid"])
    try:

        def pending() -> bool:
            rec = store.get_replica("m-0")
            return rec is not None and rec.state is ReplicaState.PENDING

        await passes(reconciler, "the replica pending", pending)
        rec = store.get_replica("m-0")
        assert rec is not None
        assert rec.message.startswith("no room: node n1 lost; no room for replica m-0 off n1")
        (no_room,) = [e for e in store.list_events() if e.reason == "NoRoom"]
        assert no_room.type == "Warning"
        assert "stays pending" in no_room.message
    finally:
        launchers["n1"].cut = False
        os.killpg(old_pid, signal.SIGCONT)
        deployer.stop_process(old)


async def test_a_scale_up_with_no_room_waits_pending_and_is_not_retried_in_a_tight_loop(
    tmp_path: Path, store: StateStore, client: httpx.AsyncClient
) -> None:
    deployer, _ = make_deployer(tmp_path, store, ["n1"])
    deployer.deploy(DeploymentSpec(name="m", model="sarv-tiny", engine=EngineKind.SIM), timeout=60)
    # The deployment now asks for 2 at least: the one node holds 1.
    record = store.get_deployment("m")
    assert record is not None
    store.put_deployment(
        record.model_copy(
            update={"spec": record.spec.model_copy(update={"min_replicas": 2, "max_replicas": 2})}
        )
    )
    config = ControllerConfig(period_s=0.1, unplaced_backoff_s=3600)
    reconciler = Reconciler(store=store, client=client, config=config, deployer=deployer)
    try:
        for _ in range(5):
            await reconciler.run_once()
        no_room = [e for e in store.list_events("m") if e.reason == "NoRoom"]
        assert len(no_room) == 1  # one try, then the back-off
        assert "every node holds a replica" in no_room[0].message
        pending = [r for r in store.list_replicas("m") if r.state is ReplicaState.PENDING]
        assert [r.message for r in pending] == ["no room: every node holds a replica"]
        text = generate_latest(reconciler.metrics.registry).decode()
        assert 'sarv_deployment_unplaced_replicas{deployment="m",reason="no_room"} 1.0' in text
        assert 'sarv_autoscaler_decisions_total{deployment="m",direction="up"} 1.0' in text
    finally:
        for rec in store.list_replicas():
            deployer.stop_process(rec)
