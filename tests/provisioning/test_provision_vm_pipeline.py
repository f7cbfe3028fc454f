"""A pipeline-parallel replica of the ``vllm`` engine joined across two GPU-node VMs.

Two QEMU VMs, each made a GPU node as ``test_provision_vm_docker.py`` makes one (the ``docker`` role with
its defaults, NVIDIA's programs and vLLM's image replaced by stand-ins, one declared L4 each), sit on a
private network (10.99.0.11 and .12). This machine joins that network from a network namespace of the
test's own (:mod:`fixtures.l2hub`, 10.99.0.1), as a service node sits on a fleet's network: ``llmctl`` and
the gateway run there and reach the nodes on their private addresses, SSH included.

``llmctl inventory --discover`` reads both nodes (the private interface named as ``sarv_nic``), and
``llmctl deploy sarv-tiny --pp 2 --engine vllm`` plans one pipeline stage on each node's L4 and runs it
as on a GPU fleet:

- the weights are verified here, copied once to one node and from there to the other over the private
  network, with the source's host key checked;
- on each node a Ray member runs in a container of the engine image under a systemd unit (``ray start
  --head`` on the first, ``--address`` of the head on the second), confined (AppArmor, no new
  privileges, not privileged), on the host network, holding its stage's GPU (the device driver's hook
  is asked for that UUID);
- the two members form one Ray cluster with two GPUs, joined over the private interface (``ray status``
  asked inside the head's container);
- the engine container on the head node is the cluster's driver (``RAY_ADDRESS``, ``VLLM_HOST_IP`` and
  NCCL/GLOO pinned to the private interface, ``--distributed-executor-backend ray``), serves on the
  head's private address, and answers a chat completion through the gateway;
- ``llmctl undeploy`` removes every container and unit on both nodes.

What only a GPU host proves: vLLM placing its stages' workers on the cluster and NCCL between them (the
engine here is Sarv's simulator on vLLM's command line, which does not use Ray itself), and NVIDIA's hook
handing the devices over.

Opt-in (``scripts/test -m vm tests/provisioning/test_provision_vm_pipeline.py``): two VMs under software
emulation take about the time the default run's VM process has left (docs/provisioning.md).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.ansible import tail
from fixtures.engine_stand_in import (
    DOCKER_GPU_NODE_PLAY,
    ENGINE_IMAGE,
    STAND_IN_LOG,
    build_engine_image,
    install_nvidia_stand_ins,
)
from fixtures.l2hub import PrivateNetwork, private_network
from fixtures.testhosts import ONE_GPU_TOPO, l4_query
from fixtures.vllm import LlmctlEnv
from fixtures.vms import VM, Fleet, booted_fleet

from controlplane.launchers.ray import ray_active_nodes

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(3600)]

GPU_UUIDS = ("GPU-00000000-aaaa-bbbb-cccc-0000000000b1", "GPU-00000000-aaaa-bbbb-cccc-0000000000b2")
CACHE = "/var/lib/sarv/models"


@pytest.fixture(scope="module")
def net() -> Iterator[PrivateNetwork]:
    with private_network() as n:
        yield n


@pytest.fixture(scope="module")
def fleet(
    ssh_keypair: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory, net: PrivateNetwork
) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("vm-pipeline")
    # 2 GiB each: a Ray member (GCS, raylet, its workers) and the engine beside dockerd.
    with booted_fleet(workdir, ssh_keypair[0], count=2, hub=net.hub, memory_mib=2048) as f:
        yield f


def _private_nic(vm: VM) -> str:
    """The name the guest gave its private interface (the one with the private network's MAC)."""
    links = vm.ssh("ip -o link").stdout
    mac = f"52:54:00:5a:01:{vm.index:02x}"
    [name] = [
        m.group(1) for m in re.finditer(r"^\d+: (\S+?):.*link/ether (\S+)", links, re.M) if m.group(2) == mac
    ]
    return name


# A chat completion at argv[1] for model argv[2] with the key in SARV_TEST_KEY, once the gateway answers and
# lists the replica (bounded: 240 tries); prints the status and the body.
_CHAT = """
import os, sys, time
import httpx

url, model = sys.argv[1:3]
headers = {"Authorization": "Bearer " + os.environ["SARV_TEST_KEY"]}
body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
for _ in range(240):
    try:
        r = httpx.post(url + "/v1/chat/completions", headers=headers, json=body, timeout=60)
    except httpx.TransportError:
        time.sleep(0.5)
        continue
    if r.status_code != 503:
        break
    time.sleep(0.5)
print(r.status_code)
print(r.text)
"""


def test_this_namespace_reaches_both_nodes_on_the_private_network(fleet: Fleet, net: PrivateNetwork) -> None:
    for vm in fleet.vms:
        address = f"10.99.0.{11 + vm.index}"
        out = subprocess.run(
            net.argv(
                [
                    "ssh",
                    "-i",
                    str(vm.key_path),
                    "-o",
                    "StrictHostKeyChecking=no",
                    "-o",
                    "UserKnownHostsFile=/dev/null",
                    "-o",
                    "BatchMode=yes",
                    "-o",
                    "ConnectTimeout=30",
                    f"root@{address}",
                    "hostname",
                ]
            ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.stdout.strip() == vm.name, out.stderr
    other = "10.99.0.12"
    assert fleet.vms[0].ssh(f"ping -c 1 -W 10 {other}", check=False).returncode == 0


def test_pp2_replica_joins_a_ray_cluster_of_engine_containers_across_the_two_nodes(
    fleet: Fleet, net: PrivateNetwork, ssh_keypair: tuple[Path, str], tmp_path: Path
) -> None:
    converge = fleet.playbook("converge", DOCKER_GPU_NODE_PLAY, timeout=1800)
    assert converge.returncode == 0, tail(converge.stdout, 120)
    work = tmp_path / "stand-ins"
    work.mkdir()
    for vm, uuid in zip(fleet.vms, GPU_UUIDS, strict=True):
        install_nvidia_stand_ins(vm, l4_query(uuid), ONE_GPU_TOPO, work)
        build_engine_image(vm, ENGINE_IMAGE, work, ray=True)
    head, worker = fleet.vms
    nic = _private_nic(head)
    assert _private_nic(worker) == nic

    cli = LlmctlEnv.create(tmp_path / "home")
    cli.prefix = net.argv([])
    cli.env |= {
        "SARV_SSH_KEY_FILE": str(ssh_keypair[0]),
        "SARV_REMOTE_PYTHON": "/usr/bin/python3",
        # Ray's start under software emulation takes minutes, not seconds.
        "SARV_RAY_JOIN_TIMEOUT_S": "1200",
    }
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        "[gpu_nodes]\n"
        + "".join(
            f"{vm.name} ansible_host=10.99.0.{11 + vm.index} ansible_user=root sarv_nic={nic}\n"
            for vm in fleet.vms
        )
    )
    found = cli.llmctl("inventory", "-i", str(inventory), "--discover", "-o", "json", timeout=600, check=True)
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_text(found.stdout)
    nodes = json.loads(found.stdout)["nodes"]
    assert [(n["name"], n["nic"], [g["uuid"] for g in n["gpus"]]) for n in nodes] == [
        (vm.name, nic, [uuid]) for vm, uuid in zip(fleet.vms, GPU_UUIDS, strict=True)
    ]
    cli.env["SARV_INVENTORY"] = str(fleet_file)

    deploy = (
        "deploy",
        "sarv-tiny",
        "--name",
        "pipe",
        "--engine",
        "vllm",
        "--pp",
        "2",
        "--max-model-len",
        "512",
    )
    gateway: subprocess.Popen[bytes] | None = None
    gateway_log = (tmp_path / "gateway.log").open("wb")
    try:
        out = cli.llmctl(*deploy, "--timeout", "1800", timeout=2700)
        if out.returncode != 0:  # the journal outlives the removed units: show it for the post-mortem
            for vm in fleet.vms:
                print(vm.name, vm.ssh("journalctl -u 'sarv-*' --no-pager -n 200", check=False).stdout)
        assert out.returncode == 0, out.stdout + out.stderr
        [dep] = [d for d in cli.status()["deployments"] if d["name"] == "pipe"]
        [rec] = dep["replicas"]
        assert rec["state"] == "ready", rec
        assert [(s["node"], s["pp_rank"]) for s in rec["shards"]] == [(head.name, 0), (worker.name, 1)]
        assert rec["endpoint"].startswith("http://10.99.0.11:"), rec

        # One container per member on each node, and the engine beside the head's; all confined.
        def containers(vm: VM) -> list[str]:
            return sorted(
                vm.ssh("docker ps --format '{{.Names}}' --filter label=sarv.deployment=pipe").stdout.split()
            )

        assert containers(head) == ["sarv-pipe-0", "sarv-pipe-0-ray-head"]
        assert containers(worker) == ["sarv-pipe-0-ray-worker"]
        members = [(head, "sarv-pipe-0-ray-head"), (worker, "sarv-pipe-0-ray-worker")]
        for (vm, name), uuid in zip(members, GPU_UUIDS, strict=True):
            info = json.loads(vm.ssh(f"docker inspect {name}").stdout)[0]
            host = info["HostConfig"]
            assert info["AppArmorProfile"] == "docker-default" and host["Privileged"] is False
            assert "no-new-privileges:true" in host["SecurityOpt"]
            assert host["NetworkMode"] == "host"
            [request] = host["DeviceRequests"]
            assert request["DeviceIDs"] == [uuid], request
            assert f"container {info['Id']} asked for devices {uuid}" in vm.ssh(f"cat {STAND_IN_LOG}").stdout
            env = info["Config"]["Env"]
            assert f"NCCL_SOCKET_IFNAME={nic}" in env and f"VLLM_HOST_IP=10.99.0.{11 + vm.index}" in env
            [weights] = [m for m in info["Mounts"] if m["Destination"] == "/models/sarv-tiny"]
            assert weights["RW"] is False and weights["Source"].startswith(f"{CACHE}/sarv-tiny/")
            assert vm.ssh(f"test -s {weights['Source']}/SHA256SUMS", check=False).returncode == 0
            assert vm.ssh(f"systemctl is-active {name}.service").stdout.strip() == "active"

        # The members formed one cluster over the private interface, two GPUs in it.
        engine = json.loads(head.ssh("docker inspect sarv-pipe-0").stdout)[0]
        [address] = [e.split("=", 1)[1] for e in engine["Config"]["Env"] if e.startswith("RAY_ADDRESS=")]
        assert address.startswith("10.99.0.11:")
        status = head.ssh(
            f"docker exec sarv-pipe-0-ray-head ray status --address {address}", timeout=600
        ).stdout
        assert ray_active_nodes(status) == 2, status
        assert re.search(r"/2\.0 GPU", status), status
        cmd = engine["Config"]["Cmd"]
        assert cmd[cmd.index("--distributed-executor-backend") + 1] == "ray"
        assert cmd[cmd.index("--pipeline-parallel-size") + 1] == "2"
        assert engine["HostConfig"]["NetworkMode"] == "host"
        assert "stand-in for vLLM" in head.ssh("docker logs sarv-pipe-0 2>&1").stdout

        # Through the gateway, in the namespace like the control plane.
        key = cli.llmctl("keys", "create", "tester", "-o", "json", check=True)
        api_key = json.loads(key.stdout)["key"]
        gateway = subprocess.Popen(
            [
                *cli.prefix,
                sys.executable,
                "-m",
                "controlplane.cli.main",
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                "18080",
                "--metrics-port",
                "0",
            ],
            env=cli.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=gateway_log,
        )
        reply = subprocess.run(
            net.argv([sys.executable, "-c", _CHAT, "http://127.0.0.1:18080", "pipe"]),
            env={**cli.env, "SARV_TEST_KEY": api_key},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        status_line, _, body = reply.stdout.partition("\n")
        assert status_line == "200", reply.stdout + reply.stderr + (tmp_path / "gateway.log").read_text()
        assert json.loads(body)["choices"][0]["message"]["content"]
    finally:
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=30)
        gateway_log.close()
        undeployed = cli.llmctl("undeploy", "pipe", "--yes", timeout=600)
    assert undeployed.returncode == 0, undeployed.stdout + undeployed.stderr
    for vm in fleet.vms:
        assert vm.ssh("docker ps -aq --filter label=sarv.deployment=pipe").stdout.strip() == ""
        assert vm.ssh("ls /etc/systemd/system | grep '^sarv-pipe' || true").stdout.strip() == ""
