"""What ``llmctl plan`` shows is what ``llmctl deploy`` runs on a GPU fleet: the GPU table's variant and
dtype, the plan's tp × pp and GPUs, the variant's weights, the generation's image, tool calling; and every
refusal comes before a byte is copied or anything started. Remote GPU nodes are stand-ins that record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.launchers import RecordingLauncher
from placement.plan_fleets import node as gpu_node

from controlplane.catalog import Catalog
from controlplane.catalog.compat import CompatTable, load_compat
from controlplane.cli.main import main
from controlplane.controller import Deployer, default_engines
from controlplane.errors import LaunchError, UserError
from controlplane.placement import plan
from controlplane.settings import Settings, load_settings
from controlplane.spec import (
    DeploymentSpec,
    Dtype,
    EngineKind,
    Fleet,
    Node,
    Plan,
    Quantization,
    ReplicaPlan,
    Shard,
)
from controlplane.state import open_store
from controlplane.weights import write_manifest

CAT = Catalog.load()


def _fleet_file(path: Path, nodes: list[tuple[str, str, int, int]]) -> Path:
    doc = {
        "version": 1,
        "nodes": [
            {
                "name": name,
                "address": f"10.0.0.{i + 1}",
                "interconnect": "nvlink",
                "gpus": [{"index": g, "model": model, "memory_total_mib": mib} for g in range(count)],
            }
            for i, (name, model, count, mib) in enumerate(nodes)
        ],
    }
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture
def gpu_fleet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[RecordingLauncher]:
    """An A100 node and a T4 node; the launchers ``llmctl deploy`` got for them come back."""
    fleet = _fleet_file(
        tmp_path / "fleet.json", [("a100-1", "A100-SXM4-80GB", 4, 81920), ("t4-1", "Tesla T4", 1, 15360)]
    )
    (tmp_path / "absent.yaml").write_text("{}\n")
    monkeypatch.setenv("SARV_CONFIG", str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("SARV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SARV_STATE_URL", f"sqlite:///{tmp_path / 'state.db'}")
    monkeypatch.setenv("SARV_INVENTORY", str(fleet))
    monkeypatch.delenv("SARV_CATALOG", raising=False)
    monkeypatch.delenv("SARV_VLLM_IMAGE", raising=False)
    made: list[RecordingLauncher] = []

    def launcher_for(node: Node, *args: object, **kwargs: object) -> RecordingLauncher:
        launcher = RecordingLauncher(node)
        made.append(launcher)
        return launcher

    monkeypatch.setattr("controlplane.launchers.launcher_for", launcher_for)
    return made


def _weights(path: Path, quant: dict[str, object] | None = None, dtype: str = "bfloat16") -> str:
    path.mkdir(parents=True)
    config: dict[str, object] = {"architectures": ["LlamaForCausalLM"], "torch_dtype": dtype}
    if quant is not None:
        config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"weights")
    write_manifest(path)
    return str(path)


def _deploy(*args: str) -> int:
    with pytest.raises(SystemExit) as exc:
        main(["deploy", *args, "--engine", "vllm", "--no-wait"])
    return int(exc.value.code or 0)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _nothing_happened(launchers: list[RecordingLauncher]) -> None:
    assert all(not launcher.copied and not launcher.launches for launcher in launchers)
    settings = load_settings()
    store = open_store(settings.resolved_state_url, settings)
    try:
        assert store.list_deployments() == [] and store.list_replicas() == []
    finally:
        store.close()


# --- the planner reads the GPU table


def test_auto_never_picks_a_variant_the_gpu_cannot_run() -> None:
    fleet = Fleet(nodes=[gpu_node("t1", "Tesla T4", 1, 15360)])
    p = plan(
        fleet, DeploymentSpec(name="d", model="m", quantization=Quantization.AUTO), CAT.get("llama-3-8b")
    )
    # bf16 does not fit 16 GB; fp8 would, but Turing has no fp8 kernel: int8 is the next that runs.
    assert p.unplaced == 0 and [r.quantization for r in p.replicas] == [Quantization.INT8]
    assert [(r.dtype, r.generation) for r in p.replicas] == [(Dtype.FP16, "turing")]


def test_an_explicit_variant_the_gpu_cannot_run_is_refused_naming_node_and_gpu() -> None:
    fleet = Fleet(nodes=[gpu_node("t1", "Tesla T4", 1, 15360)])
    p = plan(fleet, DeploymentSpec(name="d", model="m", quantization=Quantization.FP8), CAT.get("llama-3-8b"))
    assert p.unplaced == 1
    assert "t1: Tesla T4: turing GPUs have no fp8 kernel" in "\n".join(p.reasons)


def test_dtype_follows_the_gpu_and_explain_names_the_row() -> None:
    fleet = Fleet(nodes=[gpu_node("t1", "Tesla T4", 1, 15360), gpu_node("a1", "A100-SXM4-80GB", 1, 81920)])
    spec = DeploymentSpec(name="d", model="m", replicas=2, quantization=Quantization.AWQ)
    p = plan(fleet, spec, CAT.get("llama-3-8b"), explain=True)
    assert sorted((r.shards[0].node, r.dtype) for r in p.replicas) == [("a1", Dtype.BF16), ("t1", Dtype.FP16)]
    notes = "\n".join(p.notes)
    assert "Tesla T4 is row turing" in notes and "bfloat16 becomes float16" in notes
    assert "A100-SXM4-80GB is row ampere" in notes


# --- deploy runs the plan


def test_the_engine_runs_the_plans_pp_variant_dtype_and_image(
    gpu_fleet: list[RecordingLauncher], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # llama-70b fp8 at tp=1 does not fit one 80 GB GPU: the planner picks pp=2 in the A100 node.
    fp8 = _weights(tmp_path / "fp8", {"quant_method": "fp8", "activation_scheme": "dynamic"})
    bf16 = _weights(tmp_path / "bf16")
    code = _deploy("llama-70b", "--quantization", "fp8", "--source", bf16, "--source", f"fp8={fp8}",
                   "--max-model-len", "4096")  # fmt: skip
    assert code == 0, capsys.readouterr().err
    [launch] = [x for launcher in gpu_fleet for x in launcher.launches]
    argv = launch.argv
    assert _flag(argv, "--pipeline-parallel-size") == "2" and _flag(argv, "--tensor-parallel-size") == "1"
    assert _flag(argv, "--gpus") == '"device=0,1"'
    assert launch.stage_gpus == {"a100-1": ["0", "1"]}  # what a Ray group offers per node (--num-gpus)
    assert _flag(argv, "--quantization") == "fp8" and _flag(argv, "--dtype") == "bfloat16"
    assert f"vllm/vllm-openai:{load_compat().by_name('ampere').image.tag}" in argv
    assert [c for launcher in gpu_fleet for c in launcher.copied] == [fp8]  # the fp8 variant's weights


def test_tools_turn_on_the_catalogs_parser(
    gpu_fleet: list[RecordingLauncher], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _weights(tmp_path / "w")
    assert _deploy("qwen2.5-7b", "--tools", "--source", src, "--max-model-len", "4096") == 0, (
        capsys.readouterr().err
    )
    [launch] = [x for launcher in gpu_fleet for x in launcher.launches]
    assert "--enable-auto-tool-choice" in launch.argv and _flag(launch.argv, "--tool-call-parser") == "hermes"


# --- every refusal before a byte is copied


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["sarv-tiny", "--quantization", "fp8"], 2, "sarv-tiny has no fp8 variant"),
        (["llama-3-8b", "--quantization", "fp8", "--max-model-len", "4096", "--node-selector-t4"], 3,
         "turing GPUs have no fp8 kernel"),
        (["llama-3-8b", "--tools", "--max-model-len", "4096"], 2, "llama-3-8b has no tool-call parser"),
        (["llama-3-8b", "--max-model-len", "4096", "--source-awq"], 6,
         "holds the awq variant (quant_method awq, torch_dtype float16), but the plan runs llama-3-8b's "
         "none"),
    ],
)  # fmt: skip
def test_refusals_come_before_anything_is_copied_or_started(
    gpu_fleet: list[RecordingLauncher],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    code: int,
    says: str,
) -> None:
    if "--node-selector-t4" in args:
        args.remove("--node-selector-t4")
        only_t4 = _fleet_file(tmp_path / "t4.json", [("t4-1", "Tesla T4", 1, 15360)])
        monkeypatch.setenv("SARV_INVENTORY", str(only_t4))
    if "--source-awq" in args:
        args.remove("--source-awq")
        args += ["--source", _weights(tmp_path / "awq", {"quant_method": "awq", "bits": 4}, "float16")]
    assert _deploy(*args) == code
    assert says in capsys.readouterr().err
    _nothing_happened(gpu_fleet)


def test_a_replica_spanning_generations_with_different_images_is_refused_first(tmp_path: Path) -> None:
    table = load_compat()
    rows = [
        r.model_copy(update={"image": r.image.model_copy(update={"tag": f"v-{r.name}"})})
        for r in table.generations
    ]
    compat = CompatTable.model_validate({**table.model_dump(), "generations": [r.model_dump() for r in rows]})
    fleet = Fleet(nodes=[gpu_node("a1", "A100-SXM4-80GB", 1, 81920), gpu_node("h1", "H100", 1, 81920)])
    mixed = Plan(
        model="llama-70b",
        deployment="d",
        replicas=[
            ReplicaPlan(tp=1, pp=2, per_gpu_memory_gib=1.0, max_concurrency=1,
                        shards=[Shard(node="a1", gpus=[0], pp_rank=0), Shard(node="h1", gpus=[0], pp_rank=1)])
        ],
    )  # fmt: skip
    deployer, launchers = _recording_deployer(tmp_path, fleet, planner=lambda *_: mixed, compat=compat)
    spec = DeploymentSpec(name="d", model="llama-70b", engine=EngineKind.VLLM, source=str(tmp_path))
    with pytest.raises(UserError, match=r"spans GPU generations \(ampere, hopper\).*\(v-ampere, v-hopper\)"):
        deployer.deploy(spec, wait=False)
    assert not launchers and deployer.store.list_deployments() == []
    deployer.store.close()


def _recording_deployer(
    tmp_path: Path,
    fleet: Fleet,
    *,
    planner: object = plan,
    group: bool = True,
    compat: CompatTable | None = None,
) -> tuple[Deployer, list[RecordingLauncher]]:
    """A Deployer on recording nodes (and a recording Ray group launcher, standing in for the head's)."""
    settings = Settings(home=tmp_path / "home")
    launchers: list[RecordingLauncher] = []

    def factory(node: Node) -> RecordingLauncher:
        launchers.append(RecordingLauncher(node))
        return launchers[-1]

    deployer = Deployer(
        settings=settings,
        store=open_store(f"sqlite:///{tmp_path / 'state.db'}", settings),
        fleet=fleet,
        catalog=CAT,
        planner=planner,  # type: ignore[arg-type]
        launcher_factory=factory,
        group_launcher_factory=(lambda nodes: factory(nodes[0])) if group else None,
        engines=default_engines(settings),
        compat=compat or load_compat(),
    )
    return deployer, launchers


def _two_node_deployer(tmp_path: Path, *, group: bool) -> tuple[Deployer, list[RecordingLauncher]]:
    fleet = Fleet(nodes=[gpu_node(n, "A100-SXM4-80GB", 8, 81920, nvlink=True) for n in ("a100-1", "a100-2")])
    return _recording_deployer(tmp_path, fleet, group=group)


def test_a_replica_spanning_two_nodes_runs_as_a_ray_cluster_of_engine_containers(tmp_path: Path) -> None:
    deployer, launchers = _two_node_deployer(tmp_path, group=True)
    # 405B bf16 at tp=8 needs two 8-GPU A100 nodes: pp=2, one stage per node.
    spec = DeploymentSpec(name="big", model="llama-3.1-405b", tp=8, max_model_len=4096,
                          engine=EngineKind.VLLM, source=_weights(tmp_path / "bf16"))  # fmt: skip
    deployer.deploy(spec, wait=False)
    [launch] = [x for launcher in launchers for x in launcher.launches]
    assert launch.stage_gpus == {"a100-1": [str(g) for g in range(8)], "a100-2": [str(g) for g in range(8)]}
    argv = launch.argv
    # The server: the Ray driver, on the head member's host network, IPC and session volume, no GPUs.
    assert _flag(argv, "--ipc") == "container:sarv-big-0-ray-head" and _flag(argv, "--network") == "host"
    assert _flag(argv, "--volumes-from") == "sarv-big-0-ray-head"
    assert "--gpus" not in argv and "--publish" not in argv and "--privileged" not in " ".join(argv)
    assert _flag(argv, "--pipeline-parallel-size") == "2" and _flag(argv, "--tensor-parallel-size") == "8"
    assert _flag(argv, "--distributed-executor-backend") == "ray"
    assert (_flag(argv, "--host"), _flag(argv, "--port")) == ("a100-1", "8100")  # the node's address
    # Each member: the same image running `ray …`, with its stage's GPUs filled in by the launcher.
    member = launch.ray_member_argv
    assert member[-2:] == ["ray", f"vllm/vllm-openai:{load_compat().by_name('ampere').image.tag}"]
    assert _flag(member, "--gpus") == '"device={gpus}"' and _flag(member, "--name") == "{name}"
    assert _flag(member, "--network") == "host" and "no-new-privileges:true" in member
    # The driver joins the head's IPC (--ipc container:…): Docker refuses that unless the head shares it.
    assert _flag(member, "--ipc") == "shareable"
    assert [c for launcher in launchers for c in launcher.copied] == [spec.source]
    deployer.store.close()


def test_without_a_group_launcher_a_two_node_replica_is_refused_before_any_copy(tmp_path: Path) -> None:
    deployer, launchers = _two_node_deployer(tmp_path, group=False)
    spec = DeploymentSpec(name="big", model="llama-3.1-405b", tp=8, max_model_len=4096,
                          engine=EngineKind.VLLM, source=_weights(tmp_path / "bf16"))  # fmt: skip
    with pytest.raises(LaunchError, match="the plan spans nodes a100-1, a100-2"):
        deployer.deploy(spec, wait=False)
    assert all(not x.copied and not x.launches for x in launchers)
    assert deployer.store.list_deployments() == [] and deployer.store.list_replicas() == []
    deployer.store.close()
