"""A deployment being launched by ``llmctl deploy`` is left alone by the controller until its replicas are
recorded: the launch marks the record (``launching_until``) and clears the mark when it is done. A mark left
by a controller that lost the lease (it died mid-scale) does not keep its successor off the deployment."""

from __future__ import annotations

import time
from types import SimpleNamespace

from fixtures.fleets import gpu_fleet

from controlplane.controller.reconcile import Reconciler
from controlplane.spec import DeploymentRecord, DeploymentSpec, EngineKind, Plan


def test_deploy_marks_the_record_while_it_launches_and_clears_the_mark(sim_deployer) -> None:
    d = sim_deployer(gpu_fleet())
    d.marker = "controller-a"
    seen: list[float] = []
    by: set[str] = set()

    def progress(_key: str, _text: str) -> None:
        record = d.store.get_deployment("web")
        if record is not None:
            seen.append(record.launching_until)
            by.add(record.launching_by)

    d.progress = progress
    start = time.time()
    d.deploy(DeploymentSpec(name="web", model="sarv-tiny", engine=EngineKind.SIM), timeout=120)
    assert seen, "the deploy said nothing while its record existed"
    assert all(mark > start + 120 for mark in seen), "marked for the whole launch, past its timeout"
    assert by == {"controller-a"}, by
    record = d.store.get_deployment("web")
    assert record is not None and record.launching_until == 0.0 and record.launching_by == ""


def _record(name: str, launching_until: float, by: str = "") -> DeploymentRecord:
    spec = DeploymentSpec(name=name, model="sarv-tiny", engine=EngineKind.SIM)
    return DeploymentRecord(
        spec=spec, plan=Plan(model="sarv-tiny"), launching_until=launching_until, launching_by=by
    )


def _controller(holder: str | None, leading: bool = True) -> SimpleNamespace:
    lease = SimpleNamespace(holder=holder) if holder is not None else None
    return SimpleNamespace(clock=lambda: 100.0, lease=lease, _was_leader=leading, _stale_marks=set())


def test_the_controller_acts_only_on_deployments_not_being_launched() -> None:
    records = [_record("launching", 200.0), _record("settled", 0.0), _record("mark-ran-out", 50.0)]
    managed = Reconciler._managed(_controller(None), records)  # type: ignore[arg-type]
    assert [r.name for r in managed] == ["settled", "mark-ran-out"]


def test_a_mark_left_by_a_controller_that_lost_the_lease_is_ignored_by_the_leader() -> None:
    records = [
        _record("by-llmctl", 200.0),
        _record("by-me", 200.0, by="controller-b"),
        _record("by-the-dead-leader", 200.0, by="controller-a"),
    ]
    leader = _controller("controller-b")
    for _ in range(2):  # said once, ignored every pass
        managed = Reconciler._managed(leader, records)  # type: ignore[arg-type]
        assert [r.name for r in managed] == ["by-the-dead-leader"]
    assert leader._stale_marks == {("by-the-dead-leader", "controller-a")}
    # A standby leaves every mark alone: the controller that set it may well be the one leading.
    standby = _controller("controller-b", leading=False)
    assert Reconciler._managed(standby, records) == []  # type: ignore[arg-type]
