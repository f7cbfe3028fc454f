"""A multi-node replica of the container engine: a Ray cluster of engine-image containers, one per node.

What runs here: the real ``VllmEngine`` argv, the real ``RayLauncher`` sequencing and the real systemd unit
rendering, on stand-in nodes that record the files written and the commands run instead of using SSH.
The members' and the driver's container options also run on this machine's Docker (the driver joining the
head member's IPC and Ray session). Not here: the containers on two nodes. A container test host cannot run
containers (Docker in a container needs --privileged, refused here); the whole replica, members joined into
one Ray cluster across two VM nodes and the driver serving, runs in
tests/provisioning/test_provision_vm_pipeline.py (opt-in), and only a GPU fleet shows NCCL use the planned
GPUs; ``tests/remote/test_remote_ray.py`` runs the same launcher with real units on two container hosts for
the process engines.
"""

from __future__ import annotations

import shlex
import subprocess
import uuid
from pathlib import Path, PurePosixPath

import pytest
from fixtures.common import need
from fixtures.testhosts import IMAGE as TESTHOST_IMAGE
from pydantic import SecretStr

from controlplane.engines.base import ReplicaContext
from controlplane.engines.vllm import VllmEngine
from controlplane.launchers.ray import RayLauncher
from controlplane.launchers.ssh import RemoteResult, SshLauncher, UnitState
from controlplane.spec import DeploymentSpec, EngineKind, Node, ReplicaPlan, Shard

IMAGE = "vllm/vllm-openai:v0.32.0-cu129"


class RecordingStage(SshLauncher):
    """An SSH launcher whose node only records: files written, commands run, units started."""

    def __init__(self, node: Node) -> None:
        super().__init__(
            node,
            None,  # type: ignore[arg-type]  # no connection: run/put_text are recorded below
            host=node.address,
            python="/opt/sarv/venv/bin/python",
            remote_cache=PurePosixPath("/var/lib/sarv/models"),
            local_cache=Path("/nonexistent"),
        )
        self.files: dict[str, str] = {}
        self.commands: list[str] = []
        self.removed: list[str] = []

    def run(self, command: str, *, timeout: float | None = None, check: bool = True) -> RemoteResult:
        self.commands.append(command)
        if " ray status " in f" {command} ":
            return RemoteResult(0, "Active:\n 1 node_aa\n 1 node_bb\nPending:\n", "")
        return RemoteResult(0, "", "")

    def put_text(self, path: PurePosixPath, text: str, *, mode: int = 0o644) -> None:
        self.files[str(path)] = text

    def real_python(self) -> str:
        return self.python

    def allocate_port(self, preferred: int | None = None) -> int:
        return preferred or 6390

    def unit_state(self, unit: str) -> UnitState:
        return UnitState(load="loaded", active="active", sub="running", exit_status=None)

    def remove_unit(self, unit: str, *, timeout: float = 30.0) -> None:
        self.removed.append(unit)


def _ctx() -> ReplicaContext:
    shards = [Shard(node="g1", gpus=[0, 1], pp_rank=0), Shard(node="g2", gpus=[0, 1], pp_rank=1)]
    spec = DeploymentSpec(name="big", model="llama-70b", tp=2, pp=2, engine=EngineKind.VLLM)
    return ReplicaContext(
        replica_id="big-0",
        spec=spec,
        served_model_name="big",
        model_dir=Path("/var/lib/sarv/models/llama-70b/abcd"),
        host="10.0.0.1",
        port=8101,
        shards=shards,
        gpu_ids=["GPU-a0", "GPU-a1"],
        api_key=SecretStr("sk-engine-do-not-print"),
        env_file=Path("/run/sarv/big-0.env"),
        replica=ReplicaPlan(tp=2, pp=2, per_gpu_memory_gib=60.0, max_concurrency=4, shards=shards),
        image=IMAGE,
    )


def _exec_start(unit_text: str) -> list[str]:
    line = next(ln for ln in unit_text.splitlines() if ln.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def test_members_driver_and_teardown_of_a_two_node_container_replica() -> None:
    g1 = RecordingStage(Node(name="g1", address="10.0.0.1", nic="ens5"))
    g2 = RecordingStage(Node(name="g2", address="10.0.0.2", nic="ens5"))
    launch = VllmEngine().build(_ctx())
    launch = launch.model_copy(
        update={"stage_gpus": {"g1": ["GPU-a0", "GPU-a1"], "g2": ["GPU-b0", "GPU-b1"]}}
    )
    handle = RayLauncher([g1, g2], ray_version="2.49.2", sleep=lambda _s: None).start("big-0", launch)

    # No venv Ray check: the members run the image's own Ray.
    assert not any("import ray" in c for c in g1.commands + g2.commands)
    head = _exec_start(g1.files["/etc/systemd/system/sarv-big-0-ray-head.service"])
    worker = _exec_start(g2.files["/etc/systemd/system/sarv-big-0-ray-worker.service"])
    for argv, name, gpus in ((head, "sarv-big-0-ray-head", "GPU-a0,GPU-a1"),
                             (worker, "sarv-big-0-ray-worker", "GPU-b0,GPU-b1")):  # fmt: skip
        assert argv[:2] == ["docker", "run"] and "--detach" not in argv  # systemd supervises it
        assert argv[argv.index("--name") + 1] == name
        assert argv[argv.index("--gpus") + 1] == f'"device={gpus}"'
        assert argv[argv.index("--network") + 1] == "host"
        assert "NCCL_SOCKET_IFNAME=ens5" in argv and "GLOO_SOCKET_IFNAME=ens5" in argv
        i = argv.index(IMAGE)
        assert argv[i - 2 : i] == ["--entrypoint", "ray"] and argv[i + 1 : i + 3] == ["start", "--block"]
        assert argv[argv.index("--num-gpus") + 1] == "2"
        assert "--privileged" not in argv and "{" not in " ".join(argv)
    assert head[head.index("--node-ip-address") + 1] == "10.0.0.1" and "--head" in head
    assert worker[worker.index("--address") + 1] == "10.0.0.1:6390"
    # Joined: asked inside the head member's container.
    assert any(
        c.endswith("docker exec sarv-big-0-ray-head ray status --address 10.0.0.1:6390") for c in g1.commands
    )

    unit = g1.files["/etc/systemd/system/sarv-big-0.service"]
    driver = _exec_start(unit)
    assert driver[driver.index("--ipc") + 1] == "container:sarv-big-0-ray-head"
    assert "RAY_ADDRESS=10.0.0.1:6390" in driver and "VLLM_HOST_IP=10.0.0.1" in driver
    assert driver[driver.index("--distributed-executor-backend") + 1] == "ray"
    assert "sk-engine-do-not-print" not in unit and "ExecStop=" in unit
    assert g1.files["/etc/sarv/replicas/sarv-big-0.env"].strip() == "VLLM_API_KEY=sk-engine-do-not-print"
    assert handle["nodes"] == "g1,g2" and handle["ray_address"] == "10.0.0.1:6390"

    # Teardown in reverse: driver, worker, head.
    RayLauncher([g1, g2]).stop(handle)
    assert g1.removed == ["sarv-big-0.service", "sarv-big-0-ray-head.service"]
    assert g2.removed == ["sarv-big-0-ray-worker.service"]


def _on_this_docker(argv: list[str], name: str, command: list[str]) -> list[str]:
    """A member's or the driver's ``docker run`` as built, run here: detached, under ``name``, without the
    GPU request (no device driver here), the engine image and its command replaced by the test host image
    and ``command``, the weights' bind mount left out."""
    i = argv.index(IMAGE)
    options, out = argv[2 : i - 2], ["docker", "run", "--detach"]  # up to --entrypoint X
    skip = {"--gpus", "--name", "--volume", "--restart"}
    j = 0
    while j < len(options):
        if options[j] in skip:
            if options[j] == "--volume" and ":" not in options[j + 1]:
                out += options[j : j + 2]  # the member's anonymous /tmp/ray volume stays
            j += 2
            continue
        out.append(options[j])
        j += 1
    return [*out, "--name", name, TESTHOST_IMAGE, *command]


@pytest.mark.docker
def test_the_driver_container_joins_the_head_members_ipc_and_ray_session_on_docker() -> None:
    """Docker accepts the driver's ``--ipc container:<head>`` and ``--volumes-from <head>`` against the
    head member as the engine builds it: the driver sees the member's /dev/shm and its /tmp/ray."""
    need(subprocess.run(["docker", "info"], capture_output=True, check=False).returncode == 0,
         "no Docker daemon (scripts/test starts dockerd)")  # fmt: skip
    launch = VllmEngine().build(_ctx())
    suffix = uuid.uuid4().hex[:8]
    head, driver = f"sarv-ipc-head-{suffix}", f"sarv-ipc-driver-{suffix}"
    member = [a.replace("{name}", head).replace("{gpus}", "GPU-a0") for a in launch.ray_member_argv]
    member_run = _on_this_docker([*member, "start"], head, ["sh", "-c", "echo up > /dev/shm/mark; "
                                 "echo session > /tmp/ray/mark; sleep 120"])  # fmt: skip
    driver_argv = [a.replace("sarv-big-0-ray-head", head) for a in launch.argv]
    driver_run = _on_this_docker(driver_argv, driver, ["sh", "-c", "cat /dev/shm/mark /tmp/ray/mark"])
    try:
        subprocess.run(member_run, check=True, capture_output=True, text=True, timeout=120)
        started = subprocess.run(driver_run, capture_output=True, text=True, timeout=120, check=False)
        assert started.returncode == 0, started.stderr
        subprocess.run(["docker", "wait", driver], check=True, capture_output=True, timeout=120)
        logs = subprocess.run(
            ["docker", "logs", driver], capture_output=True, text=True, timeout=60, check=True
        )
        assert logs.stdout.split() == ["up", "session"]
    finally:
        subprocess.run(
            ["docker", "rm", "-f", "-v", driver, head], capture_output=True, timeout=120, check=False
        )
