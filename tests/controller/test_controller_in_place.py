"""Settings that do not change what a deployment's replicas run (replica bounds, scale to zero) change in
place: ``llmctl deploy`` and ``apply`` write them without restarting a replica or starting a rollout; a
change of anything else is still a conflict for ``deploy`` and a rollout for ``apply``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fixtures.fleets import gpu_fleet

from controlplane.controller import Deployer
from controlplane.controller.apply import Action, plan_changes
from controlplane.errors import UserError
from controlplane.spec import DeploymentSpec, EngineKind, spec_version


def test_bounds_and_scale_to_zero_change_in_place_and_the_rest_does_not(
    sim_deployer: Callable[..., Deployer],
) -> None:
    d = sim_deployer(gpu_fleet(nodes=2, gpus=1))
    spec = DeploymentSpec(name="web", model="sarv-tiny", engine=EngineKind.SIM)
    d.deploy(spec, timeout=120)
    before = {(r.id, r.handle["pid"]) for r in d.store.list_replicas("web")}

    wider = spec.model_copy(update={"max_replicas": 3, "scale_to_zero": True, "idle_timeout_s": 60})
    assert spec_version(wider) == spec_version(spec)
    assert [c.action for c in plan_changes(d, [wider])] == [Action.SCALE]
    result = d.deploy(wider, timeout=120)
    assert result.changed
    assert result.notes == [
        "updated idle_timeout_s None -> 60, max_replicas None -> 3, scale_to_zero None -> True"
    ]
    record = d.store.get_deployment("web")
    assert record is not None and record.spec == wider
    assert {(r.id, r.handle["pid"]) for r in d.store.list_replicas("web")} == before  # nothing restarted
    [updated] = [e for e in d.store.list_events("web") if e.reason == "Updated"]
    assert updated.message.endswith("(in place)")
    assert d.store.get_rollout("web") is None

    # With the replica count as well: the settings are written, then the deployment scales.
    two = wider.model_copy(update={"replicas": 2, "min_replicas": 2})
    result = d.deploy(two, timeout=120)
    assert result.notes[0] == "updated min_replicas None -> 2"
    assert d.store.get_deployment("web").spec == two
    assert len(d.store.list_replicas("web")) == 2

    other = two.model_copy(update={"engine_args": {"ttft_ms": 5}})
    assert [c.action for c in plan_changes(d, [other])] == [Action.ROLLOUT]
    with pytest.raises(UserError, match="already exists with different engine_args"):
        d.deploy(other, timeout=120)
    mixed = other.model_copy(update={"max_replicas": 4})
    assert [c.action for c in plan_changes(d, [mixed])] == [Action.REFUSED]
