"""The reconcile loop against real simulator processes, a real SQLite store and a real redis-server."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest
import redis
from fixtures.common import free_port
from fixtures.fleets import gpu_fleet
from fixtures.sim import SimFactory, SimProcess

from controlplane.controller.autoscale import AutoscaleConfig
from controlplane.controller.events import record_event
from controlplane.controller.lease import RedisLease
from controlplane.controller.reconcile import (
    ControllerConfig,
    ControllerMetrics,
    Reconciler,
    load_controller_config,
)
from controlplane.errors import ConfigError
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


def replica(name: str, index: int, endpoint: str, state: ReplicaState = ReplicaState.READY) -> ReplicaRecord:
    return ReplicaRecord(
        id=f"{name}-{index}",
        deployment=name,
        index=index,
        model=name,
        engine=EngineKind.SIM,
        node="localhost",
        endpoint=endpoint,
        state=state,
        created_at=1.0,
        updated_at=1.0,
    )


def deployment(name: str, replicas: int) -> DeploymentRecord:
    spec = DeploymentSpec(name=name, model="sarv-tiny", replicas=replicas, engine=EngineKind.SIM)
    return DeploymentRecord(spec=spec, plan=Plan(model="sarv-tiny", deployment=name))


def dead_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"


def kill(sim: SimProcess) -> None:
    sim.proc.kill()
    sim.proc.wait(timeout=10)


def target_ids(path: Path) -> list[str]:
    return [g["labels"]["replica"] for g in json.loads(path.read_text())]


async def test_killed_replica_turns_unhealthy_after_n_passes_and_ready_when_back(
    sim_server: SimFactory, store: StateStore, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    sim = sim_server(served_model_name="m")
    store.put_replica(replica("m", 0, sim.url))
    targets = tmp_path / "file_sd" / "sarv-replicas.json"
    config = ControllerConfig(failure_threshold=3, probe_timeout_s=2, targets_file=targets)
    rec = Reconciler(store=store, client=client, config=config)

    report = await rec.run_once()
    assert report.failed_phases == []
    assert target_ids(targets) == ["m-0"]

    kill(sim)
    states = []
    for _ in range(3):
        report = await rec.run_once()
        assert report.failed_phases == []
        got = store.get_replica("m-0")
        assert got is not None
        states.append(got.state)
    assert states == [ReplicaState.READY, ReplicaState.READY, ReplicaState.UNHEALTHY]
    assert got.message.startswith("health check failed 3 times in a row: ")
    assert got.updated_at > 1.0
    assert target_ids(targets) == []

    sim_server(served_model_name="m", port=sim.port)
    report = await rec.run_once()
    got = store.get_replica("m-0")
    assert got is not None
    assert (got.state, got.message) == (ReplicaState.READY, "")
    assert report.changed == ["m-0"]
    assert target_ids(targets) == ["m-0"]


async def test_a_success_between_failures_restarts_the_count(
    sim_server: SimFactory, store: StateStore, client: httpx.AsyncClient
) -> None:
    sim = sim_server(served_model_name="m")
    store.put_replica(replica("m", 0, sim.url))
    rec = Reconciler(store=store, client=client, config=ControllerConfig(failure_threshold=2))
    kill(sim)
    await rec.run_once()  # 1 failure
    sim = sim_server(served_model_name="m", port=sim.port)
    await rec.run_once()  # success: the streak restarts
    kill(sim)
    await rec.run_once()  # 1 failure again
    got = store.get_replica("m-0")
    assert got is not None and got.state is ReplicaState.READY
    await rec.run_once()
    got = store.get_replica("m-0")
    assert got is not None and got.state is ReplicaState.UNHEALTHY


async def test_targets_list_only_ready_replicas(
    sim_server: SimFactory, store: StateStore, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    up = sim_server(served_model_name="a")
    store.put_replica(replica("a", 0, up.url))
    store.put_replica(replica("a", 1, dead_endpoint(), ReplicaState.UNHEALTHY))
    store.put_replica(replica("a", 2, dead_endpoint(), ReplicaState.STARTING))
    store.put_replica(replica("a", 3, dead_endpoint(), ReplicaState.FAILED))
    targets = tmp_path / "targets.json"
    rec = Reconciler(store=store, client=client, config=ControllerConfig(targets_file=targets))
    report = await rec.run_once()
    assert report.failed_phases == []
    assert report.probed == 3  # the failed replica is not probed
    assert target_ids(targets) == ["a-0"]
    group = json.loads(targets.read_text())[0]
    assert group["targets"] == [f"127.0.0.1:{up.port}"]
    assert group["labels"]["deployment"] == "a"


async def test_loading_replica_becomes_ready_once_it_serves_its_model(
    sim_server: SimFactory, store: StateStore, client: httpx.AsyncClient
) -> None:
    sim = sim_server(served_model_name="s")
    store.put_replica(replica("s", 0, sim.url, ReplicaState.STARTING))
    store.put_replica(replica("s", 1, dead_endpoint(), ReplicaState.STARTING))
    rec = Reconciler(store=store, client=client, config=ControllerConfig(failure_threshold=1))
    report = await rec.run_once()
    assert report.changed == ["s-0"]
    loading = store.get_replica("s-1")
    assert loading is not None
    # Failing probes of a loading replica are not health failures: the deployer's timeout judges it.
    assert loading.state is ReplicaState.STARTING


async def test_a_record_deleted_during_the_pass_is_not_written_back(
    sim_server: SimFactory, store: StateStore, client: httpx.AsyncClient
) -> None:
    sim = sim_server(served_model_name="m")
    store.put_replica(replica("m", 0, sim.url, ReplicaState.STARTING))

    class DeletingClient(httpx.AsyncClient):
        """Undeploys the replica while its probe is in flight, as a concurrent `llmctl undeploy` would."""

        async def get(self, url: httpx.URL | str, **kw: object) -> httpx.Response:  # type: ignore[override]
            store.delete_replica("m-0")
            return await super().get(url, **kw)  # type: ignore[arg-type]

    async with DeletingClient(timeout=2.0, trust_env=False) as deleting:
        rec = Reconciler(store=store, client=deleting)
        report = await rec.run_once()
    assert report.changed == []
    assert store.get_replica("m-0") is None


async def test_a_failing_phase_is_logged_and_the_others_still_run(
    sim_server: SimFactory,
    store: StateStore,
    client: httpx.AsyncClient,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sim = sim_server(served_model_name="m")
    store.put_replica(replica("m", 0, sim.url))
    store.put_deployment(deployment("m", 1))
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    metrics = ControllerMetrics()
    config = ControllerConfig(targets_file=blocker / "targets.json")
    rec = Reconciler(store=store, client=client, config=config, metrics=metrics)
    with caplog.at_level(logging.ERROR, logger="controlplane.controller.reconcile"):
        report = await rec.run_once()
    assert report.failed_phases == ["targets"]
    assert "controller phase targets failed" in caplog.text
    assert "m" in report.decisions  # autoscale ran after the failed phase
    assert metrics.registry.get_sample_value("sarv_controller_phase_errors_total", {"phase": "targets"}) == 1


async def test_phase_durations_and_replica_counts_are_exported(
    sim_server: SimFactory, store: StateStore, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    sim = sim_server(served_model_name="m")
    store.put_replica(replica("m", 0, sim.url))
    store.put_replica(replica("m", 1, dead_endpoint(), ReplicaState.UNHEALTHY))
    metrics = ControllerMetrics()
    config = ControllerConfig(targets_file=tmp_path / "t.json")
    rec = Reconciler(store=store, client=client, config=config, metrics=metrics)
    await rec.run_once()
    reg = metrics.registry
    for phase in ("lease", "load", "probe", "update", "targets", "autoscale"):
        value = reg.get_sample_value("sarv_controller_phase_seconds", {"phase": phase})
        assert value is not None and value >= 0, phase
    assert reg.get_sample_value("sarv_controller_loop_seconds") is not None
    assert reg.get_sample_value("sarv_controller_replicas", {"state": "ready"}) == 1
    assert reg.get_sample_value("sarv_controller_replicas", {"state": "unhealthy"}) == 1
    assert reg.get_sample_value("sarv_controller_leader") == 1


async def test_slow_pass_is_warned_about(
    store: StateStore, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    ticks = iter(range(0, 1000, 10))  # every clock read is 10 s later: any pass is "slow"
    metrics = ControllerMetrics()
    rec = Reconciler(
        store=store,
        client=client,
        config=ControllerConfig(period_s=5),
        metrics=metrics,
        monotonic=lambda: float(next(ticks)),
    )
    with caplog.at_level(logging.WARNING, logger="controlplane.controller.reconcile"):
        await rec.run_once()
    assert "controller pass took" in caplog.text
    assert metrics.registry.get_sample_value("sarv_controller_slow_loops_total") == 1


async def test_recommended_replicas_from_real_replica_metrics(
    sim_server: SimFactory, store: StateStore, client: httpx.AsyncClient
) -> None:
    sims = [sim_server(served_model_name="m") for _ in range(2)]
    for i, sim in enumerate(sims):
        store.put_replica(replica("m", i, sim.url))
    store.put_deployment(deployment("m", 2))
    store.put_deployment(deployment("fixed", 1))
    store.put_replica(replica("fixed", 0, sims[0].url))
    metrics = ControllerMetrics()
    config = ControllerConfig(
        deployments={"m": AutoscaleConfig(min_replicas=1, max_replicas=4, downscale_delay_s=0)}
    )
    rec = Reconciler(store=store, client=client, config=config, metrics=metrics)
    report = await rec.run_once()
    m = report.decisions["m"]
    assert (m.current, m.recommended, m.load) == (2, 1, 0.0)  # idle sims: 0 waiting + 0 running
    assert report.decisions["fixed"].recommended == 1  # default policy: bounds are --replicas
    reg = metrics.registry
    assert reg.get_sample_value("sarv_controller_recommended_replicas", {"deployment": "m"}) == 1
    assert reg.get_sample_value("sarv_controller_current_replicas", {"deployment": "m"}) == 2

    store.delete_deployment("m")
    await rec.run_once()
    assert reg.get_sample_value("sarv_controller_recommended_replicas", {"deployment": "m"}) is None


async def test_unreadable_metrics_hold_the_recommendation(
    sim_server: SimFactory, store: StateStore, client: httpx.AsyncClient
) -> None:
    sim = sim_server(served_model_name="m")
    kill(sim)
    store.put_replica(replica("m", 0, sim.url))
    store.put_replica(replica("m", 1, sim.url))
    store.put_deployment(deployment("m", 2))
    config = ControllerConfig(
        failure_threshold=5, autoscale=AutoscaleConfig(min_replicas=1, max_replicas=4, downscale_delay_s=0)
    )
    report = await Reconciler(store=store, client=client, config=config).run_once()
    d = report.decisions["m"]
    assert (d.current, d.recommended) == (2, 2)
    assert "no load metrics" in d.reason


@pytest.mark.redis
async def test_two_controllers_one_acts_and_the_standby_takes_over_after_expiry(
    sim_server: SimFactory, redis_url: str, client: httpx.AsyncClient
) -> None:
    sim = sim_server(served_model_name="m")
    store = open_store(redis_url)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        store.put_replica(replica("m", 0, sim.url))
        key = "{sarv:}controller-lease"
        cfg = ControllerConfig(failure_threshold=1)
        a = Reconciler(
            store=store, client=client, config=cfg, lease=RedisLease(raw, key, ttl_s=1.0, holder="a")
        )
        b = Reconciler(
            store=store, client=client, config=cfg, lease=RedisLease(raw, key, ttl_s=30, holder="b")
        )
        ra = await a.run_once()
        kill(sim)
        rb = await b.run_once()
        assert (ra.leader, rb.leader) == (True, False)
        assert rb.probed == 0 and rb.changed == []  # the standby did nothing, not even probing
        got = store.get_replica("m-0")
        assert got is not None and got.state is ReplicaState.READY
        assert b.metrics.registry.get_sample_value("sarv_controller_leader") == 0

        # "a" stops without releasing (a crash): "b" acts only once the lease has expired.
        passes = 0
        while True:
            rb = await b.run_once()
            passes += 1
            if rb.leader:
                break
            assert raw.get(key) != "b"  # "a" holds it, or it just expired
            assert passes < 400, "the standby never took over"
            await _sleep(0.05)
        assert rb.changed == ["m-0"]
        got = store.get_replica("m-0")
        assert got is not None and got.state is ReplicaState.UNHEALTHY
        assert raw.get(key) == "b"

        # The old leader comes back: it is the standby now.
        ra = await a.run_once()
        assert ra.leader is False
        b.release()
        assert raw.get(key) is None
    finally:
        raw.close()
        store.close()


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


def test_config_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text(
        "period_s: 10\nfailure_threshold: 4\nautoscale:\n  target_ongoing_requests: 16\n"
        "deployments:\n  chat:\n    min_replicas: 1\n    max_replicas: 6\n"
    )
    cfg = load_controller_config(path, period_s=2.5, targets_file=None)
    assert (cfg.period_s, cfg.failure_threshold) == (2.5, 4)
    assert cfg.policy_for("chat").max_replicas == 6
    assert cfg.policy_for("other").target_ongoing_requests == 16


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("period_s: -1\n", "period_s"),
        ("nope: 1\n", "nope"),
        ("- a\n", "mapping"),
        ("a: [\n", "not valid YAML"),
        ("autoscale:\n  min_replicas: 0\n", "scale_to_zero"),
    ],
)
def test_bad_config_is_one_line(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        load_controller_config(path)
    assert "\n" not in str(err.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read controller config"):
        load_controller_config(tmp_path / "absent.yaml")


@pytest.mark.slow
async def test_replicas_of_a_real_deploy_are_promoted_and_listed(
    tmp_path: Path, client: httpx.AsyncClient
) -> None:
    """`llmctl deploy --no-wait` records loading replicas; the controller marks them ready and lists them."""
    import asyncio

    from fixtures.vllm import LlmctlEnv, kill_groups

    env = LlmctlEnv.create(tmp_path / "home")
    targets = tmp_path / "targets.json"
    store = open_store(env.env["SARV_STATE_URL"])
    try:
        env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--replicas", "2", "--no-wait", check=True)
        rec = Reconciler(store=store, client=client, config=ControllerConfig(targets_file=targets))
        for _ in range(300):
            await rec.run_once()
            if all(r.state is ReplicaState.READY for r in store.list_replicas()):
                break
            await asyncio.sleep(0.1)
        states = {r.id: r.state for r in store.list_replicas()}
        assert states == {"sarv-tiny-0": ReplicaState.READY, "sarv-tiny-1": ReplicaState.READY}
        assert target_ids(targets) == ["sarv-tiny-0", "sarv-tiny-1"]
        report = await rec.run_once()
        assert report.decisions["sarv-tiny"].recommended == 2  # default policy: what was deployed

        env.llmctl("undeploy", "sarv-tiny", check=True, timeout=60)
        await rec.run_once()
        assert target_ids(targets) == []
    finally:
        pids = [int(r.handle["pid"]) for r in store.list_replicas() if r.handle.get("pid")]
        store.close()
        env.llmctl("undeploy", "sarv-tiny", timeout=60)
        assert kill_groups(pids) == []


def _on(rec: ReplicaRecord, node: str, gpu: int) -> ReplicaRecord:
    return rec.model_copy(update={"node": node, "shards": [Shard(node=node, gpus=[gpu], pp_rank=0)]})


async def test_deployment_and_node_series_and_a_draining_replica_left_alone(
    sim_server: SimFactory, store: StateStore, client: httpx.AsyncClient
) -> None:
    """The series the operations dashboard reads, set each pass; a draining replica is left to its drain
    (never probed, judged or counted as capacity)."""
    sim = sim_server(served_model_name="web")
    store.put_deployment(deployment("web", 3))
    store.put_replica(_on(replica("web", 0, sim.url), "gpu-a", 0))
    # Its engine is gone, but it is draining: the controller must not mark it unhealthy or failed.
    store.put_replica(_on(replica("web", 1, dead_endpoint(), ReplicaState.DRAINING), "gpu-b", 1))
    no_room = "no room: 1 of 3 replica(s) could not be placed"
    pending = replica("web", 2, "", ReplicaState.PENDING)
    store.put_replica(pending.model_copy(update={"endpoint": None, "node": "", "message": no_room}))
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


async def test_gateway_queue_wait_is_read_from_a_token_protected_metrics_listener(
    store: StateStore, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    from controlplane.gateway.admin import AdminListener
    from controlplane.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.child(metrics.queue, "m").observe(0.25)
    listener = AdminListener(port=0, token="controller-reads-0123456789")
    await listener.start(metrics)
    try:
        host, port = listener.address
        url = f"http://{host}:{port}/metrics"
        token = tmp_path / "gateway-metrics.token"
        token.write_text("controller-reads-0123456789\n")
        without = Reconciler(store=store, client=client, config=ControllerConfig(gateway_metrics=[url]))
        assert (
            without._gateway_queues(["m"], await without._gateway_pages())["m"] == ()
        )  # 401: the queue is unknown, not empty
        config = ControllerConfig(gateway_metrics=[url], gateway_metrics_token_file=token)
        rec = Reconciler(store=store, client=client, config=config)
        [(source, histogram)] = rec._gateway_queues(["m"], await rec._gateway_pages())["m"]
        assert source == url and histogram.count == 1
    finally:
        await listener.stop()
