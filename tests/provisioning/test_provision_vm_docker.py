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
4. on a kernel whose AppArmor is off (``aa-enabled`` made to read "N"), the role refuses to go on.

The image carries ``docker.io`` installed but disabled (the VM's network reaches no package mirror), so the
role's install step finds the package present; repository set-up, pins and installation from a mirror stay
covered by the container scenario. Not run here: the RHEL-family branch, where the same probe would read
an SELinux label (``system_u:system_r:container_t:s0:c…``) from ``/proc/self/attr/current`` and
``docker info`` would list ``selinux``; no RHEL-family image or repository is reachable from these machines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.ansible import tail
from fixtures.vms import Fleet, booted_fleet, recap_changed

# Opt-in with the other VM scenarios (``scripts/test -m vm tests/provisioning/``), see docs/provisioning.md.
pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(1800)]

CONVERGE = """---
- name: Container engine on a VM
  hosts: vms
  gather_facts: true
  gather_subset: [min]
  roles:
    - role: docker
"""

# A two-file image made inside the VM from its own binaries: nothing is pulled.
PROBE_IMAGE = "sarv-probe:1"
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
