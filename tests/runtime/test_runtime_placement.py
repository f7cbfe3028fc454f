"""``llmctl deploy`` records the plan it launches: the CLI's placement wiring, with remote launches recorded
by a stand-in launcher instead of SSH; ``sim`` on this host's declared GPUs as real local processes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fixtures.fleets import gpu_fleet, llmctl_on_fleet
from fixtures.launchers import RecordingLauncher
from fixtures.vllm import LlmctlEnv, group_members

from controlplane.cli.main import main
from controlplane.engines.base import ReplicaContext
from controlplane.engines.sim import SimEngine
from controlplane.settings import load_settings
from controlplane.spec import DeploymentRecord, DeploymentSpec, EngineKind, Node, Shard
from controlplane.state import open_store


@pytest.fixture
def remote_fleet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[RecordingLauncher]:
    """A fleet of two remote CPU nodes; the launchers ``llmctl deploy`` got for them come back."""
    fleet = tmp_path / "fleet.json"
    nodes = [{"name": "cpu-1", "address": "10.0.0.1"}, {"name": "cpu-2", "address": "10.0.0.2"}]
    fleet.write_text(json.dumps({"version": 1, "nodes": nodes}))
    (tmp_path / "absent.yaml").write_text("{}\n")
    monkeypatch.setenv("SARV_CONFIG", str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("SARV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SARV_STATE_URL", f"sqlite:///{tmp_path / 'state.db'}")
    monkeypatch.setenv("SARV_INVENTORY", str(fleet))
    monkeypatch.delenv("SARV_CATALOG", raising=False)
    made: list[RecordingLauncher] = []

    def launcher_for(node: Node, *args: object, **kwargs: object) -> RecordingLauncher:
        launcher = RecordingLauncher(node)
        made.append(launcher)
        return launcher

    monkeypatch.setattr("controlplane.launchers.launcher_for", launcher_for)
    return made


def _deploy(*args: str) -> int:
    with pytest.raises(SystemExit) as exc:
        main(["deploy", "sarv-tiny", *args])
    return int(exc.value.code or 0)


def _record(name: str) -> DeploymentRecord:
    settings = load_settings()
    store = open_store(settings.resolved_state_url, settings)
    try:
        record = store.get_deployment(name)
    finally:
        store.close()
    assert record is not None
    return record


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_vllm_cpu_on_a_remote_fleet_is_recorded_with_the_tp_it_is_launched_with(
    remote_fleet: list[RecordingLauncher], capsys: pytest.CaptureFixture[str]
) -> None:
    code = _deploy(
        "--engine", "vllm-cpu", "--tp", "2", "--replicas", "2", "--no-wait",
        "--source", "/srv/weights/sarv-tiny", "--engine-arg", "omp_threads_bind=0|1",
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    record = _record("sarv-tiny")
    launches = [launch for launcher in remote_fleet for launch in launcher.launches]
    assert len(launches) == len(record.plan.replicas) == 2
    assert [r.shards[0].node for r in record.plan.replicas] == ["cpu-1", "cpu-2"]
    for replica, launch in zip(record.plan.replicas, launches, strict=True):
        assert replica.tp == int(_flag(launch.argv, "--tensor-parallel-size")) == 2
        assert replica.pp == int(_flag(launch.argv, "--pipeline-parallel-size")) == 1


# --- sim on declared GPUs


def test_sim_on_gpus_tells_its_process_which_gpus_it_holds() -> None:
    spec = DeploymentSpec(name="rehearsal", model="llama-70b", tp=2, engine=EngineKind.SIM)
    ctx = ReplicaContext(
        replica_id="rehearsal-0", spec=spec, served_model_name="rehearsal", port=8101,
        shards=[Shard(node="gpu-a1", gpus=[2, 3], pp_rank=0)], gpu_ids=["GPU-aaa", "GPU-bbb"],
    )  # fmt: skip
    assert SimEngine().build(ctx).env["CUDA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-bbb"
    cpu = ctx.model_copy(update={"shards": [Shard(node="n", gpus=[], pp_rank=0)], "gpu_ids": []})
    assert "CUDA_VISIBLE_DEVICES" not in SimEngine().build(cpu).env


@pytest.fixture
def gpu_host(tmp_path: Path) -> Iterator[LlmctlEnv]:
    """``llmctl`` whose fleet is this host, declared with two GPUs; whatever is left is undeployed."""
    with llmctl_on_fleet(tmp_path, gpu_fleet(gpus=2, names=["localhost"])) as e:
        yield e


def test_sim_on_this_hosts_declared_gpus_runs_locally_on_them(gpu_host: LlmctlEnv) -> None:
    out = gpu_host.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--replicas", "2", check=True)
    assert "sarv-tiny: deployed" in out.stdout
    [dep] = gpu_host.status()["deployments"]
    assert [(r["node"], r["gpus"], r["state"]) for r in dep["replicas"]] == [
        ("localhost", [0], "ready"),
        ("localhost", [1], "ready"),
    ]
    for r in dep["replicas"]:
        assert r["endpoint"].startswith("http://127.0.0.1:")
        assert group_members(r["pid"])
        resp = httpx.get(f"{r['endpoint']}/v1/models", timeout=30)
        assert resp.status_code == 200, resp.text
    environ = Path(f"/proc/{dep['replicas'][1]['pid']}/environ").read_bytes().split(b"\0")
    assert b"CUDA_VISIBLE_DEVICES=1" in environ
    # A vllm deployment planned now sees both GPUs taken by the rehearsal.
    taken = gpu_host.llmctl("deploy", "sarv-tiny", "--name", "real", "--engine", "vllm", "--no-wait")
    assert taken.returncode == 3, taken.stderr
    assert "localhost: 0 free A100-SXM4-80GB" in taken.stderr
    gpu_host.llmctl("undeploy", "sarv-tiny", check=True)
    assert not any(group_members(r["pid"]) for r in dep["replicas"])
