"""The idle decision of scale to zero in simulated time: quiet for the timeout goes to zero; a request, a
moved count, a restarted engine or an unknown restarts the run."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.controller import llmctl_env
from fixtures.vllm import LlmctlEnv

from controlplane.controller.idle import Activity, IdleWatch, activity_of, idle_seen
from controlplane.controller.reconcile import ProbeResult
from controlplane.engines.metrics import HistogramSample
from controlplane.errors import ConfigError
from controlplane.gateway.config import load_gateway_config
from controlplane.spec import DeploymentRecord, DeploymentSpec, EngineKind, Plan, ReplicaRecord, ReplicaState

__all__ = ["llmctl_env"]  # the fixture, imported for this module

QUIET = Activity(served=5.0, ongoing=0.0)


def run(steps: list[tuple[float, Activity]], timeout: float = 60.0) -> list[bool]:
    watch = IdleWatch()
    out = []
    for now, activity in steps:
        watch, idle = idle_seen(watch, now, activity, timeout)
        out.append(idle)
    return out


def test_quiet_for_the_timeout_is_idle_and_not_a_period_before() -> None:
    steps = [(float(t), QUIET) for t in range(0, 65, 5)]
    idle = run(steps)
    assert idle[:12] == [False] * 12  # t = 0 … 55
    assert idle[12]  # t = 60


def test_a_request_in_flight_restarts_the_run() -> None:
    busy = Activity(served=5.0, ongoing=1.0)
    steps = [(0.0, QUIET), (50.0, QUIET), (55.0, busy), (100.0, QUIET), (114.0, QUIET), (115.0, QUIET)]
    assert run(steps) == [False, False, False, False, False, True]


def test_a_count_that_moved_between_passes_restarts_the_run() -> None:
    served = Activity(served=6.0, ongoing=0.0)  # a request started and finished between two passes
    steps = [(0.0, QUIET), (50.0, served), (100.0, served), (110.0, served)]
    assert run(steps) == [False, False, False, True]


def test_a_restarted_engine_counting_from_zero_is_activity() -> None:
    steps = [(0.0, QUIET), (59.0, Activity(served=0.0, ongoing=0.0)), (61.0, Activity(0.0, 0.0))]
    assert run(steps) == [False, False, False]


def test_an_unknown_is_never_taken_for_quiet() -> None:
    unknown = Activity(served=None, ongoing=None)
    # The run starts again at the first pass that knows (61 s), not at the unknown one.
    steps = [(0.0, QUIET), (30.0, unknown), (61.0, QUIET), (120.0, QUIET), (121.0, QUIET)]
    assert run(steps) == [False, False, False, False, True]


def _dep() -> DeploymentRecord:
    spec = DeploymentSpec(name="web", model="sarv-tiny", engine=EngineKind.SIM, scale_to_zero=True)
    return DeploymentRecord(spec=spec, plan=Plan(model="sarv-tiny"))


def _replica(index: int, state: ReplicaState = ReplicaState.READY) -> ReplicaRecord:
    return ReplicaRecord(
        id=f"web-{index}",
        deployment="web",
        index=index,
        model="web",
        engine=EngineKind.SIM,
        node="n",
        state=state,
    )


def _hist(count: float) -> HistogramSample:
    return HistogramSample((0.3, float("inf")), (count, count), 0.0)


def test_activity_sums_replica_and_gateway_counts() -> None:
    probes = {
        "web-0": ProbeResult("web-0", ok=True, ongoing=0.0, queue=_hist(3)),
        "web-1": ProbeResult("web-1", ok=True, ongoing=2.0, queue=_hist(4)),
    }
    got = activity_of(_dep(), [_replica(0), _replica(1)], probes, (("gw", _hist(10)),))
    assert got == Activity(served=17.0, ongoing=2.0)


def test_activity_is_unknown_while_a_replica_loads_or_its_metrics_are_missing() -> None:
    probes = {"web-0": ProbeResult("web-0", ok=True, ongoing=0.0, queue=_hist(3))}
    loading = [_replica(0), _replica(1, ReplicaState.STARTING)]
    assert activity_of(_dep(), loading, probes, ()) == Activity(None, None)
    unread = {"web-0": ProbeResult("web-0", ok=True)}
    assert activity_of(_dep(), [_replica(0)], unread, ()) == Activity(None, None)
    assert activity_of(_dep(), [], {}, ()) == Activity(None, None)


# --- bad configuration: one line, no traceback, nothing done


def test_idle_timeout_without_scale_to_zero_is_one_line(llmctl_env: LlmctlEnv) -> None:
    proc = llmctl_env.llmctl(
        "deploy", "sarv-tiny", "--engine", "sim", "--no-scale-to-zero", "--idle-timeout", "30"
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) <= 2 and "idle_timeout_s needs scale_to_zero" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert llmctl_env.status()["deployments"] == []


def test_bad_hold_config_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("hold:\n  max_held_per_model: -1\n")
    with pytest.raises(ConfigError) as caught:
        load_gateway_config(path)
    assert "hold.max_held_per_model" in caught.value.message
    assert "\n" not in caught.value.message


def test_records_written_before_scale_to_zero_still_load() -> None:
    old = '{"spec": {"name": "web", "model": "sarv-tiny", "engine": "sim"}, "plan": {"model": "sarv-tiny"}}'
    rec = DeploymentRecord.model_validate_json(old)
    assert rec.zero is None and rec.spec.scale_to_zero is None and rec.spec.idle_timeout_s is None
