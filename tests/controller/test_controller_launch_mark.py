"""A deployment being launched by ``llmctl deploy`` is left alone by the controller until its replicas are
recorded: the launch marks the record (``launching_until``) and clears the mark when it is done."""

from __future__ import annotations

import time
from types import SimpleNamespace

from fixtures.fleets import gpu_fleet

from controlplane.controller.reconcile import Reconciler
from controlplane.spec import DeploymentRecord, DeploymentSpec, EngineKind, Plan


def test_deploy_marks_the_record_while_it_launches_and_clears_the_mark(sim_deployer) -> None:
    d = sim_deployer(gpu_fleet())
    seen: list[float] = []

    def progress(_key: str, _text: str) -> None:
        record = d.store.get_deployment("web")
        if record is not None:
            seen.append(record.launching_until)

    d.progress = progress
    start = time.time()
    d.deploy(DeploymentSpec(name="web", model="sarv-tiny", engine=EngineKind.SIM), timeout=120)
    assert seen, "the deploy said nothing while its record existed"
    assert all(mark > start + 120 for mark in seen), "marked for the whole launch, past its timeout"
    record = d.store.get_deployment("web")
    assert record is not None and record.launching_until == 0.0


def _record(name: str, launching_until: float) -> DeploymentRecord:
    spec = DeploymentSpec(name=name, model="sarv-tiny", engine=EngineKind.SIM)
    return DeploymentRecord(spec=spec, plan=Plan(model="sarv-tiny"), launching_until=launching_until)


def test_the_controller_acts_only_on_deployments_not_being_launched() -> None:
    records = [_record("launching", 200.0), _record("settled", 0.0), _record("mark-ran-out", 50.0)]
    owner = SimpleNamespace(clock=lambda: 100.0)
    managed = Reconciler._managed(owner, records)  # type: ignore[arg-type]
    assert [r.name for r in managed] == ["settled", "mark-ran-out"]
