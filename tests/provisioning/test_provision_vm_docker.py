"""The ``docker`` role on a QEMU virtual machine: the engine's confinement as a container sees it.

A container test host shares this machine's kernel, which has no AppArmor, and its daemon needs test-only
options (no iptables, no bridge, vfs storage), so the Molecule scenario turns the LSM requirement off. Here
the VM (tests/fixtures/vms.py) has its own Debian kernel with AppArmor enforcing, and the role runs with
its defaults, ``docker_require_lsm`` on:

1. converge: the engine is enabled and running with the role's daemon.json; from inside a container, its
   AppArmor label is ``docker-default (enforce)``, ``NoNewPrivs`` is 1, the open-files limit is the role's;
   the container's log configuration is json-file with the role's rotation; cgroup driver systemd;
2. a second run changes nothing;
3. live-restore for real: a running container keeps its process across a restart of the engine;
4. the VM made a GPU node with stand-ins for NVIDIA's programs and vLLM's image
   (tests/fixtures/engine_stand_in.py): the ``nvidia`` runtime the role registers runs containers, and
   ``--gpus`` reaches the device driver's hook with the device asked for;
5. ``llmctl inventory --discover`` and ``llmctl deploy --engine vllm`` of the tiny model on the node's one
   declared L4: the ``docker run`` Sarv builds for the GPU image runs in a systemd unit under this engine,
   confined (AppArmor, no new privileges, not privileged), with the planned GPU's UUID handed to the
   device driver, the weights verified into the node's cache and mounted read-only, the port published on
   the address the control plane reaches (here through an SSH forward of the VM's loopback), the API key
   only in the process environment and a 0600 file; it serves a chat completion through a real gateway
   and is removed by ``llmctl undeploy``;
6. on a kernel whose AppArmor is off (``aa-enabled`` made to read "N"), the role refuses to go on.

What only a GPU host proves here: that NVIDIA's real hook hands the device to the container and that
vLLM's image starts on it; everything Sarv decides and runs up to that hand-off runs here.

The image carries ``docker.io`` installed but disabled (the VM's network reaches no package mirror), so the
role's install step finds the package present; repository set-up, pins and installation from a mirror stay
covered by the container scenario. Not run here: the RHEL-family branch, where the same probe would read
an SELinux label (``system_u:system_r:container_t:s0:c…``) from ``/proc/self/attr/current`` and
``docker info`` would list ``selinux``; no RHEL-family image or repository is reachable from these machines.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.ansible import tail
from fixtures.common import free_port
from fixtures.engine_stand_in import (
    DOCKER_GPU_NODE_PLAY,
    ENGINE_IMAGE,
    STAND_IN_LABEL,
    STAND_IN_LOG,
    build_engine_image,
    install_nvidia_stand_ins,
)
from fixtures.gateway import GatewayStarter, add_key, chat, gateway_factory
from fixtures.testhosts import ONE_GPU_TOPO, l4_query
from fixtures.vllm import LlmctlEnv
from fixtures.vms import Fleet, booted_fleet, recap_changed

from controlplane.launchers.units import env_file_path
from controlplane.settings import Settings
from controlplane.state import open_store

__all__ = ["gateway_factory"]  # the fixture, used by name

# In the whole run (scripts/test runs it beside the main pytest process), see docs/provisioning.md.
pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1800)]

CONVERGE = DOCKER_GPU_NODE_PLAY

# A two-file image made inside the VM from its own binaries: nothing is pulled.
PROBE_IMAGE = "sarv-probe:1"
CACHE = "/var/lib/sarv/models"
_MAKE_PROBE = (
    "tar -ch -C / usr/bin/cat lib/x86_64-linux-gnu/libc.so.6 lib64/ld-linux-x86-64.so.2 "
    f"| docker import - {PROBE_IMAGE}"
)


@pytest.fixture(scope="module")
def fleet(ssh_keypair: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with booted_fleet(tmp_path_factory.mktemp("vm-docker"), ssh_keypair[0]) as f:
        yield f


def _probe(fleet: Fleet, path: str) -> str:
    return fleet.vm.ssh(f"docker run --rm {PROBE_IMAGE} /usr/bin/cat {path}", timeout=180).stdout


def test_fresh_vm_has_apparmor_and_no_running_engine(fleet: Fleet) -> None:
    vm = fleet.vm
    assert vm.ssh("aa-enabled").stdout.strip() == "Yes"
    assert vm.ssh("systemctl is-active docker", check=False).stdout.strip() != "active"


def test_converge_confines_containers(fleet: Fleet) -> None:
    out = fleet.playbook("converge", CONVERGE)
    assert out.returncode == 0, tail(out.stdout, 120)
    vm = fleet.vm
    assert vm.ssh("systemctl is-enabled docker").stdout.strip() == "enabled"
    assert vm.ssh("systemctl is-active docker").stdout.strip() == "active"
    vm.ssh(_MAKE_PROBE, timeout=180)
    assert _probe(fleet, "/proc/self/attr/current").strip() == "docker-default (enforce)"
    status = dict(
        line.split(":\t", 1) for line in _probe(fleet, "/proc/self/status").splitlines() if ":\t" in line
    )
    assert status["NoNewPrivs"].strip() == "1", status
    limits = [ln.split() for ln in _probe(fleet, "/proc/self/limits").splitlines() if "open files" in ln]
    assert limits and limits[0][3:5] == ["1048576", "1048576"], limits
    info = json.loads(vm.ssh("docker info --format '{{json .}}'").stdout)
    assert info["LiveRestoreEnabled"] is True
    assert info["LoggingDriver"] == "json-file"
    assert info["CgroupDriver"] == "systemd"
    assert any(o.startswith("name=apparmor") for o in info["SecurityOptions"]), info["SecurityOptions"]
    assert info["Runtimes"]["nvidia"]["path"] == "nvidia-container-runtime", info["Runtimes"]
    assert info["DefaultRuntime"] == "runc"  # Sarv's launcher asks for GPUs explicitly (--gpus)
    vm.ssh(f"docker create --name sarv-log-probe {PROBE_IMAGE} /usr/bin/cat")
    log = json.loads(vm.ssh("docker inspect -f '{{json .HostConfig.LogConfig}}' sarv-log-probe").stdout)
    vm.ssh("docker rm sarv-log-probe")
    assert log == {"Type": "json-file", "Config": {"max-file": "5", "max-size": "50m"}}


def test_second_run_changes_nothing(fleet: Fleet) -> None:
    out = fleet.playbook("idempotence", CONVERGE)
    assert recap_changed(out.stdout, fleet.vm.name) == 0, tail(out.stdout, 120)


def test_live_restore_keeps_a_container_running_across_an_engine_restart(fleet: Fleet) -> None:
    vm = fleet.vm
    # `cat` with an open standard input waits for ever: a container that only stops when killed.
    cid = vm.ssh(f"docker run -d -i --name sarv-live {PROBE_IMAGE} /usr/bin/cat", timeout=180).stdout.strip()
    try:
        pid = vm.ssh(f"docker inspect -f '{{{{.State.Pid}}}}' {cid}").stdout.strip()
        assert int(pid) > 0
        vm.ssh("systemctl restart docker", timeout=300)
        assert vm.ssh(f"cat /proc/{pid}/comm").stdout.strip() == "cat"
        state = vm.ssh(f"docker inspect -f '{{{{.State.Running}}}} {{{{.State.Pid}}}}' {cid}").stdout.split()
        assert state == ["true", pid]
    finally:
        vm.ssh(f"docker rm -f {cid}", check=False, timeout=180)


# One declared L4, as the container test hosts declare theirs (tests/remote/conftest.py).
GPU_UUID = "GPU-00000000-aaaa-bbbb-cccc-0000000000a1"


@pytest.fixture(scope="module")
def gpu_node(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    """The converged VM as a GPU node: NVIDIA's programs and vLLM's image replaced by stand-ins."""
    work = tmp_path_factory.mktemp("stand-ins")
    install_nvidia_stand_ins(fleet.vm, l4_query(GPU_UUID), ONE_GPU_TOPO, work)
    build_engine_image(fleet.vm, ENGINE_IMAGE, work)
    return fleet


def test_the_nvidia_runtime_and_the_gpu_device_driver_reach_the_stand_ins(gpu_node: Fleet) -> None:
    vm = gpu_node.vm
    out = vm.ssh(
        f"docker run --rm --runtime nvidia --gpus device={GPU_UUID} {PROBE_IMAGE} "
        "/usr/bin/cat /proc/self/attr/current",
        timeout=180,
    )
    assert out.stdout.strip() == "docker-default (enforce)"  # the alias still runs runc, confined
    log = vm.ssh(f"cat {STAND_IN_LOG}").stdout
    assert "stand-in nvidia-container-runtime: runc" in log, log
    assert f"asked for devices {GPU_UUID}; no GPU attached" in log, log


def test_llmctl_deploys_a_gpu_replica_into_its_engine_container_serving_through_the_gateway(
    gpu_node: Fleet, ssh_keypair: tuple[Path, str], gateway_factory: GatewayStarter, tmp_path: Path
) -> None:
    """``llmctl deploy --engine vllm`` of the tiny model on the node's one declared L4, as an operator runs
    it: the ``docker run`` Sarv builds for the GPU image runs in a systemd unit under the role's engine,
    confined, with the planned GPU's UUID handed to the device driver, the weights verified into the node's
    cache and mounted read-only, the port published on the address the control plane reaches (here through
    an SSH forward of the VM's loopback), the API key only in the engine's environment and a 0600 file."""
    vm = gpu_node.vm
    cli = LlmctlEnv.create(tmp_path / "home")
    cli.env |= {"SARV_SSH_KEY_FILE": str(ssh_keypair[0]), "SARV_REMOTE_PYTHON": "/usr/bin/python3"}
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        f"[gpu_nodes]\n{vm.name} ansible_host=127.0.0.1 ansible_port={vm.ssh_port} ansible_user=root\n"
    )
    # The operator's way to a fleet file: GPUs read from the node's nvidia-smi over SSH.
    found = cli.llmctl("inventory", "-i", str(inventory), "--discover", "-o", "json", timeout=300, check=True)
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_text(found.stdout)
    [node] = json.loads(found.stdout)["nodes"]
    assert [(g["model"], g["uuid"], g["memory_total_mib"]) for g in node["gpus"]] == [("L4", GPU_UUID, 23034)]
    cli.env["SARV_INVENTORY"] = str(fleet_file)
    port = free_port()
    unit = "/etc/systemd/system/sarv-chat-0.service"
    deploy = ("deploy", "sarv-tiny", "--name", "chat", "--engine", "vllm", "--max-model-len", "512")
    try:
        with vm.forward(port):
            out = cli.llmctl(*deploy, "--port", str(port), "--timeout", "600", timeout=900)
            assert out.returncode == 0, out.stdout + out.stderr
            [dep] = [d for d in cli.status()["deployments"] if d["name"] == "chat"]
            [rec] = dep["replicas"]
            assert (rec["node"], rec["state"], rec["endpoint"]) == (
                vm.name,
                "ready",
                f"http://127.0.0.1:{port}",
            )

            container = json.loads(vm.ssh("docker inspect sarv-chat-0").stdout)[0]
            image = json.loads(vm.ssh(f"docker image inspect {ENGINE_IMAGE}").stdout)[0]
            assert container["Image"] == image["Id"] and image["Config"]["Labels"][STAND_IN_LABEL] == "vllm"
            host = container["HostConfig"]
            assert container["AppArmorProfile"] == "docker-default" and host["Privileged"] is False
            assert "no-new-privileges:true" in host["SecurityOpt"], host["SecurityOpt"]
            [request] = host["DeviceRequests"]
            assert request["DeviceIDs"] == [GPU_UUID] and request["Capabilities"] == [["gpu"]], request
            assert host["PortBindings"] == {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(port)}]}
            [weights] = [m for m in container["Mounts"] if m["Destination"] == "/models/sarv-tiny"]
            assert weights["RW"] is False and weights["Source"].startswith(f"{CACHE}/sarv-tiny/")
            assert vm.ssh(f"test -s {weights['Source']}/SHA256SUMS", check=False).returncode == 0
            assert host["RestartPolicy"]["Name"] in ("", "no")  # systemd supervises, not dockerd
            assert host["LogConfig"]["Type"] == "json-file"
            assert vm.ssh(f"systemctl is-active {Path(unit).name}").stdout.strip() == "active"

            # Inside: the engine process confined, with the planned device and the key in its environment.
            pid = vm.ssh("docker inspect -f '{{.State.Pid}}' sarv-chat-0").stdout.strip()
            assert vm.ssh(f"cat /proc/{pid}/attr/current").stdout.strip() == "docker-default (enforce)"
            assert "NoNewPrivs:\t1" in vm.ssh(f"cat /proc/{pid}/status").stdout
            environ = vm.ssh(f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout.splitlines()
            secret = cli.engine_key("chat")
            assert secret and f"VLLM_API_KEY={secret}" in environ
            assert f"NVIDIA_VISIBLE_DEVICES={GPU_UUID}" in environ
            hook_log = vm.ssh(f"cat {STAND_IN_LOG}").stdout
            assert f"container {container['Id']} asked for devices {GPU_UUID}" in hook_log, hook_log
            assert "stand-in for vLLM" in vm.ssh("docker logs sarv-chat-0 2>&1").stdout
            # The key is in no command line and no world-readable file on the node.
            assert secret not in vm.ssh("ps -eo args").stdout
            assert secret not in vm.ssh(f"cat {unit}").stdout
            env_file = env_file_path(Path(unit).name)
            assert vm.ssh(f"stat -c '%a %U' {env_file}").stdout.split() == ["600", "root"]

            with contextlib.closing(open_store(cli.env["SARV_STATE_URL"], Settings(home=cli.home))) as store:
                api_key = add_key(store)
                gw = gateway_factory(store)
                try:
                    resp = chat(gw.url, api_key, "chat", timeout=60)
                finally:
                    gw.stop()  # before its store closes
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"]
    finally:
        undeployed = cli.llmctl("undeploy", "chat", timeout=300)
    assert undeployed.returncode == 0, undeployed.stdout + undeployed.stderr
    assert vm.ssh("docker ps -aq --filter name=sarv-chat-0").stdout.strip() == ""
    assert vm.ssh(f"test -e {unit}", check=False).returncode != 0


def test_a_kernel_without_apparmor_is_refused(fleet: Fleet) -> None:
    vm = fleet.vm
    # What aa-enabled reads on a kernel booted with apparmor=0, without a reboot: a file over the parameter.
    vm.ssh("echo N > /run/aa-off && mount --bind /run/aa-off /sys/module/apparmor/parameters/enabled")
    try:
        assert vm.ssh("aa-enabled", check=False).stdout.strip() != "Yes"
        out = fleet.playbook("refusal", CONVERGE)
        assert out.returncode != 0, tail(out.stdout, 120)
        assert "AppArmor is not enabled in this kernel" in out.stdout, tail(out.stdout, 120)
        assert "docker_require_lsm: false" in out.stdout
    finally:
        vm.ssh("umount /sys/module/apparmor/parameters/enabled", check=False)
