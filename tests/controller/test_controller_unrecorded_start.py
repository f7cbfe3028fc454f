"""A replica is recorded before its launcher starts it, so a deploy killed between the start and the record
leaves a record without a handle instead of an engine nobody knows of; the controller that takes over stops
whatever runs under the replica's name and starts it again, so exactly the desired replicas run.

The kill is real: ``deploy`` runs in a child process whose launcher SIGKILLs it the moment the engine
(a ``sim`` process, which outlives it) has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path, PurePosixPath

import httpx
import pytest
from fixtures.fleets import gpu_fleet

from controlplane.cli.runtime import wire_deployer
from controlplane.controller.reconcile import ControllerConfig, Reconciler
from controlplane.engines.base import EngineLaunch
from controlplane.errors import LaunchError
from controlplane.launchers import claim_handle
from controlplane.launchers.local import LocalLauncher
from controlplane.launchers.ray import RayLauncher
from controlplane.launchers.ssh import SshLauncher
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, EngineKind, Node, ReplicaRecord, ReplicaState
from controlplane.state import StateStore, open_store

# The child: `deploy` of two replicas whose launcher writes the second's handle down (for the test to
# know the orphan) and SIGKILLs its own process before ``start`` returns it.
_KILLED_DEPLOY = """
import os, signal, sys
from pathlib import Path
from controlplane.cli.runtime import wire_deployer
from controlplane.launchers.local import LocalLauncher
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, EngineKind, Fleet
from controlplane.state import open_store

home, db, fleet, marker, orphan = sys.argv[1:]
settings = Settings(home=Path(home))


class KilledAfterStart(LocalLauncher):
    def start(self, replica_id, launch):
        handle = super().start(replica_id, launch)
        if replica_id.endswith("-1"):
            Path(orphan).write_text(handle["pid"])
            os.kill(os.getpid(), signal.SIGKILL)
        return handle


d = wire_deployer(settings, open_store(db, settings), Fleet.model_validate_json(Path(fleet).read_text()))
d.launcher_factory = lambda node: KilledAfterStart(settings.home, settings.resolved_model_cache)
d.marker = marker
d.deploy(DeploymentSpec(name="web", model="sarv-tiny", engine=EngineKind.SIM, replicas=2), timeout=120)
"""


class FakeLease:
    """The lease as the controller that took it over sees it: always held."""

    def __init__(self, holder: str) -> None:
        self._holder = holder

    @property
    def holder(self) -> str:
        return self._holder

    def acquire(self) -> bool:
        return True

    def held(self) -> bool:
        return True

    def owner(self) -> str | None:
        return self._holder

    def release(self) -> None:
        return None


def replica_groups(home: Path) -> dict[str, set[int]]:
    """Process groups running in each replica run directory under ``home`` (what runs, recorded or not)."""
    runs = home / "replicas"
    out: dict[str, set[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if cwd.parent == runs and fields[0] != "Z":
            out.setdefault(cwd.name, set()).add(int(fields[2]))
    return out


def kill_deploy(tmp_path: Path, marker: str) -> int:
    """Run the killed deploy; returns the pid (process group) of the engine it left unrecorded."""
    (tmp_path / "fleet.json").write_text(gpu_fleet(nodes=2, gpus=1).model_dump_json())
    (tmp_path / "killed.py").write_text(_KILLED_DEPLOY)
    orphan = tmp_path / "orphan.pid"
    args = [str(tmp_path / "home"), f"sqlite:///{tmp_path / 'state.db'}", str(tmp_path / "fleet.json")]
    child = subprocess.run(
        [sys.executable, str(tmp_path / "killed.py"), *args, marker, str(orphan)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert child.returncode == -9, child.stderr[-2000:]
    return int(orphan.read_text())


@pytest.mark.parametrize(
    ("marker", "holder"),
    [("controller-a", "controller-b"), ("", "controller-b")],
    ids=["controller-killed-mid-scale", "llmctl-deploy-killed"],
)
async def test_an_engine_started_by_a_killed_deploy_is_stopped_and_started_again_once(
    tmp_path: Path, client: httpx.AsyncClient, marker: str, holder: str
) -> None:
    orphan = kill_deploy(tmp_path, marker)
    settings = Settings(home=tmp_path / "home")
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}", settings)
    deployer = wire_deployer(settings, store, gpu_fleet(nodes=2, gpus=1))
    try:
        (first, left) = store.list_replicas("web")
        assert first.handle and left.state is ReplicaState.STARTING
        assert (left.handle, left.endpoint) == ({}, None), "recorded before its start, and only that"
        assert replica_groups(settings.home)["web-1"] == {orphan}, "the orphan runs, unrecorded"

        now = [store.get_deployment("web").launching_until - 1.0]  # type: ignore[union-attr]
        config = ControllerConfig(period_s=0.2, probe_timeout_s=1.0)
        reconciler = Reconciler(
            store=store,
            client=client,
            config=config,
            lease=FakeLease(holder),
            deployer=deployer,
            clock=lambda: now[0],
        )
        if not marker:
            # A live llmctl deploy's mark: its replica may still be starting, and is left alone.
            await reconciler.run_once()
            assert store.get_replica("web-1") == left
            assert replica_groups(settings.home)["web-1"] == {orphan}
            now[0] += 2.0  # the mark runs out: that deploy is over

        def settled() -> list[ReplicaRecord]:
            return [r for r in store.list_replicas("web") if r.state is ReplicaState.READY and r.handle]

        for _ in range(150):
            await reconciler.run_once()
            if len(settled()) == 2:
                break
            await asyncio.sleep(0.2)
        assert [r.id for r in settled()] == ["web-0", "web-1"], store.list_replicas("web")
        groups = replica_groups(settings.home)
        assert orphan not in groups.get("web-1", set()), "the unrecorded engine was stopped by name"
        assert groups == {"web-0": {int(first.handle["pid"])}, "web-1": {int(settled()[1].handle["pid"])}}
        assert any("left starting" in e.message for e in store.list_events("web"))
    finally:
        deployer.undeploy("web")
        left = replica_groups(settings.home)
        for group in {g for groups in left.values() for g in groups} | {orphan}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        store.close()
    assert left == {}, "processes left running after undeploy"


class SpyLauncher(LocalLauncher):
    """Looks up the replica's record and its deployment's launch mark as its start begins; ``fail`` makes
    the start raise."""

    def __init__(self, home: Path, cache: Path, store: StateStore) -> None:
        super().__init__(home, cache)
        self.store = store
        self.seen: list[ReplicaRecord | None] = []
        self.marks: list[float] = []
        self.fail = False

    def start(self, replica_id: str, launch: EngineLaunch) -> dict[str, str]:
        rec = self.store.get_replica(replica_id)
        self.seen.append(rec)
        dep = self.store.get_deployment(rec.deployment) if rec is not None else None
        self.marks.append(dep.launching_until if dep is not None else 0.0)
        if self.fail:
            raise LaunchError(f"cannot start {replica_id}: no such executable")
        return super().start(replica_id, launch)


def test_a_replica_is_recorded_before_its_start_and_not_at_all_when_the_start_fails(sim_deployer) -> None:
    d = sim_deployer(gpu_fleet(nodes=1, gpus=1))
    spy = SpyLauncher(d.settings.home, d.settings.resolved_model_cache, d.store)
    d.launcher_factory = lambda node: spy
    spy.fail = True
    with pytest.raises(LaunchError, match="rolled back"):
        d.deploy(DeploymentSpec(name="web", model="sarv-tiny", engine=EngineKind.SIM), timeout=60)
    assert (d.store.list_replicas(), d.store.list_deployments()) == ([], [])
    spy.fail = False
    d.deploy(DeploymentSpec(name="web", model="sarv-tiny", engine=EngineKind.SIM), timeout=60)
    for before in spy.seen:
        assert before is not None and before.state is ReplicaState.STARTING
        assert (before.handle, before.endpoint) == ({}, None)
    (rec,) = d.store.list_replicas()
    assert rec.state is ReplicaState.READY and rec.handle["pid"] and rec.endpoint


def test_a_rollouts_new_replica_marks_its_deployment_while_it_starts(sim_deployer) -> None:
    d = sim_deployer(gpu_fleet(nodes=2, gpus=1))
    d.deploy(DeploymentSpec(name="web", model="sarv-tiny", engine=EngineKind.SIM), timeout=60)
    spy = SpyLauncher(d.settings.home, d.settings.resolved_model_cache, d.store)
    d.launcher_factory = lambda node: spy  # the other node's: the new replica avoids the first one's
    record = d.store.get_deployment("web")
    assert record is not None
    placement = d.place_around(record.spec, d.catalog.get("sarv-tiny"), 1, d.store.list_replicas("web"))
    rec = d.start_version(record, record.spec, 1, placement.replicas[0])
    assert rec.handle and spy.marks and all(m > time.time() for m in spy.marks), spy.marks
    after = d.store.get_deployment("web")
    assert after is not None and after.launching_until == 0.0, "the mark is cleared once it started"


class RemovingSsh(SshLauncher):
    """An SSH node's launcher that records the units it is asked to remove (and reaches no node)."""

    def __init__(self, name: str, removed: list[tuple[str, str]]) -> None:
        super().__init__(
            Node(name=name, address="10.0.0.9"),
            None,  # type: ignore[arg-type]  # never connected: remove_unit is the only call
            host="10.0.0.9",
            python="python3",
            remote_cache=PurePosixPath("/var/lib/sarv/models"),
            local_cache=Path("/nonexistent"),
        )
        self.removed = removed

    def remove_unit(self, unit: str, *, timeout: float = 30.0) -> None:
        self.removed.append((self.node.name, unit))


def test_the_claim_of_a_remote_replica_stops_its_units_by_name() -> None:
    removed: list[tuple[str, str]] = []
    one = RemovingSsh("n1", removed)
    one.stop(claim_handle(one, "web-1"))
    assert removed == [("n1", "sarv-web-1.service")]

    removed.clear()
    ray = RayLauncher([RemovingSsh("n1", removed), RemovingSsh("n2", removed), RemovingSsh("n3", removed)])
    claim = claim_handle(ray, "web-1")
    ray.stop(claim)
    # The reverse of RayLauncher.start's order: the engine, the workers, then the head.
    assert removed == [
        ("n1", "sarv-web-1.service"),
        ("n3", "sarv-web-1-ray-worker.service"),
        ("n2", "sarv-web-1-ray-worker.service"),
        ("n1", "sarv-web-1-ray-head.service"),
    ]
    assert json.loads(claim["order"])[0] == ["n1", "sarv-web-1-ray-head.service"]
