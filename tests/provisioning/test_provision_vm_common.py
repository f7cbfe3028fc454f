"""``preflight`` and ``common`` on QEMU virtual machines: an air-gapped node installs from a signed apt
repository only, and what a container cannot show is checked on a real kernel — limits in new login
sessions, journald keeping logs across a reboot, chrony stepping a wrong clock from a time server.

A VM (tests/fixtures/vms.py) on a private network (10.99.0.0/24; nothing else is reachable from it), which
this machine joins from a network namespace of the test's own (tests/fixtures/l2hub.py, 10.99.0.1):

- the site's time server is chrony from the same repository (its ``.deb`` unpacked here), run in that
  namespace and serving its clock to the private network (``local stratum 8``); it runs with ``-x`` and
  never sets this machine's clock;
- ``sarv-vm0`` is the node: no Debian source, the repository (``build_apt_repository``, what
  ``llmctl bundle create`` puts in a bundle's ``debs/``: common's base packages and their dependencies,
  signed by a key made here) copied in and trusted, as ``llmctl bundle load`` does, and its clock set 90 s
  ahead before the converge.

In order:

1. preflight and common converge: apt points at the repository alone and common's packages come from it;
   the configuration files, pip's index and the mirrors llmctl and the engines read;
2. a new SSH login and a ``su -`` session get the open-files and locked-memory limits, root included;
3. chrony takes the time server on the private network and steps the clock back by the 90 s;
4. journald keeps its journal on disk with the configured size, and a line logged before a reboot is read
   from the previous boot after it; chrony and the limits are back too;
5. a second run changes nothing.

Molecule is not used, as in test_provision_vm_gpu_node.py: ansible-playbook runs against the VM's forwarded
SSH port. This module replaces common's container scenario and runs in the default suite (scripts/test runs it
beside the rest; about 5 minutes alone under software emulation); preflight keeps its container scenario
for the refusals, which need no kernel.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from fixtures.ansible import tail
from fixtures.bundles import gpg_signing_key, stop_gpg_agent
from fixtures.common import REPO, need_binary, stop_process
from fixtures.l2hub import ADDRESS, PrivateNetwork, private_network
from fixtures.vms import VM, Fleet, booted_fleet, recap_changed

from controlplane.bundle.create import build_apt_repository

# Marker vm: not in the main pytest process; scripts/test runs this module in a process of its own.
pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(2400)]

PACKAGES: list[str] = yaml.safe_load((REPO / "roles/common/vars/Debian.yml").read_text())["_common_packages"]
MIRROR_DIR = "/srv/sarv-mirror/debs"
MIRROR = f"file://{MIRROR_DIR}"
TIME_SERVER = ADDRESS  # this machine, in the private network's namespace
NODE = "sarv-vm0"
SKEW_S = 90
JOURNAL_MAX = "300M"
# The .deb files the bundle tests download are reused (and new ones kept there), as `llmctl bundle create`
# reuses $SARV_HOME/debs.
DEB_CACHES = [Path("/var/cache/apt/archives"), Path.home() / ".cache" / "sarv" / "bundle-tests" / "debs"]

CONVERGE = f"""---
- name: Preflight and common on an air-gapped node
  hosts: {NODE}
  gather_facts: true
  vars:
    preflight_required_groups: [gpu_nodes]
    common_apt_mirror: {MIRROR}
    common_ntp_servers: [{TIME_SERVER}]
    common_ntp_pools: []
    common_journald_system_max_use: {JOURNAL_MAX}
    common_pypi_index_url: https://pypi.example.internal/simple
    common_container_registry_mirror: https://registry.example.internal
    common_model_store_url: https://models.example.internal
  roles:
    - role: preflight
    - role: common
"""


@dataclass
class Site:
    fleet: Fleet
    node: VM
    converge: subprocess.CompletedProcess[str]
    skewed_by: float


def _host_offset(vm: VM) -> float:
    """The VM's clock minus this machine's, to within the SSH round trip."""
    before = time.time()
    guest = float(vm.ssh("date +%s.%N").stdout)
    after = time.time()
    return guest - (before + after) / 2


def _copy_repository(vm: VM, repo: Path) -> None:
    pack = subprocess.run(["tar", "-C", str(repo), "-cf", "-", "."], capture_output=True, check=True)
    out = subprocess.run(
        vm.ssh_argv(f"mkdir -p {MIRROR_DIR} && tar -C {MIRROR_DIR} -xf -"),
        input=pack.stdout,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    # What `llmctl bundle load` does on every host; and the node is air-gapped: no Debian source.
    vm.ssh(
        f"install -m 0644 {MIRROR_DIR}/sarv-bundle.asc /etc/apt/trusted.gpg.d/sarv-bundle.asc"
        " && rm -f /etc/apt/sources.list /etc/apt/sources.list.d/*"
    )


@contextlib.contextmanager
def _time_server(net: PrivateNetwork, repo: Path, workdir: Path) -> Iterator[None]:
    """chronyd from the repository's chrony package, serving time on the private network from the
    namespace; ``-x``: it never sets this machine's clock."""
    [deb] = repo.rglob("chrony_*.deb")
    root = workdir / "chrony"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=120)
    conf = workdir / "chrony.conf"
    conf.write_text(
        "local stratum 8\nallow 10.99.0.0/24\ncmdport 0\nbindcmdaddress /\n"
        f"pidfile {workdir / 'chronyd.pid'}\n"
    )
    log = (workdir / "chronyd.log").open("wb")
    argv = [str(root / "usr/sbin/chronyd"), "-x", "-d", "-u", "root", "-f", str(conf)]
    proc = subprocess.Popen(net.argv(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while ":123 " not in _udp_listeners(net):
            assert proc.poll() is None, (workdir / "chronyd.log").read_text()
            assert time.monotonic() < deadline, "chronyd did not listen on port 123 within 30 s"
            time.sleep(0.2)
        yield
    finally:
        stop_process(proc)
        log.close()


def _udp_listeners(net: PrivateNetwork) -> str:
    out = subprocess.run(net.argv(["ss", "-lun"]), capture_output=True, text=True, timeout=30, check=False)
    return out.stdout


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for tool in ("gpg", "apt-get", "apt-cache", "dpkg-scanpackages"):
        need_binary(tool)
    root = tmp_path_factory.mktemp("vm-common-repo")
    gnupghome = gpg_signing_key(root / "gnupg", "Sarv VM test repository <vm-repo@sarv.test>")
    dest = root / "debs"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GNUPGHOME", str(gnupghome))
        build_apt_repository(PACKAGES, dest, "vm-repo@sarv.test", deb_caches=DEB_CACHES, say=print)
    stop_gpg_agent(gnupghome)
    return dest


@pytest.fixture(scope="module")
def site(
    ssh_keypair: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory, repository: Path
) -> Iterator[Site]:
    need_binary("dpkg-deb")
    workdir = tmp_path_factory.mktemp("vm-common")
    with (
        private_network() as net,
        _time_server(net, repository, workdir),
        booted_fleet(workdir, ssh_keypair[0], hub=net.hub) as fleet,
    ):
        node = fleet.vm
        _copy_repository(node, repository)
        node.ssh(f"date -s @$(( $(date +%s) + {SKEW_S} ))")
        skewed_by = _host_offset(node)
        with fleet.inventory.open("a") as f:
            f.write(
                f"\n[gpu_nodes]\n{NODE}\n\n[gpu_nodes:vars]\n"
                "sarv_gpu_model=A100-SXM4-40GB\nsarv_gpu_count=1\nsarv_gpu_memory_mib=40960\n"
                "sarv_gpu_interconnect=pcie\n"
            )
        converge = fleet.playbook("converge", CONVERGE, timeout=1800)
        yield Site(fleet, node, converge, skewed_by)


def test_converge_installs_from_the_repository_alone(site: Site) -> None:
    assert site.converge.returncode == 0, tail(site.converge.stdout, 120)
    node = site.node
    sources = node.ssh("grep -rh '^deb' /etc/apt/sources.list /etc/apt/sources.list.d/ || true").stdout
    assert sorted(sources.splitlines()) == [
        f"deb {MIRROR} bookworm main",
        f"deb {MIRROR} bookworm-updates main",
    ]
    for package in PACKAGES:
        status = node.ssh(f"dpkg-query -W -f '${{Status}}' {package}").stdout
        assert status == "install ok installed", package
    policy = node.ssh("apt-cache policy chrony jq").stdout
    assert policy.count(f"file:{MIRROR_DIR} bookworm/main") == 2, policy  # apt writes file:/srv/...


def test_configuration_files_and_the_mirrors_for_pip_llmctl_and_engines(site: Site) -> None:
    node = site.node
    files = {
        "/etc/apt/sources.list": "Ansible managed",
        "/etc/pip.conf": "index-url = https://pypi.example.internal/simple",
        "/etc/sarv/mirrors.env": "SARV_REGISTRY_MIRROR=https://registry.example.internal",
        "/etc/chrony/chrony.conf": f"server {TIME_SERVER} iburst",
        "/etc/security/limits.d/90-sarv.conf": "root hard nofile  1048576",
        "/etc/systemd/journald.conf.d/90-sarv.conf": f"SystemMaxUse={JOURNAL_MAX}",
    }
    content = {}
    for path, line in files.items():
        mode, _, content[path] = node.ssh(f"stat -c '%a %U:%G' {path} && cat {path}").stdout.partition("\n")
        assert mode == "644 root:root", path
        assert line in content[path], path
    assert "SARV_MODEL_STORE_URL=https://models.example.internal" in content["/etc/sarv/mirrors.env"]
    assert "pool " not in content["/etc/chrony/chrony.conf"]
    assert node.ssh("systemctl is-enabled chrony").stdout.strip() == "enabled"


def _limits(node: VM, command: str) -> list[str]:
    return node.ssh(command).stdout.split()


def test_new_sessions_get_the_limits_root_included(site: Site) -> None:
    node = site.node
    expected = ["1048576", "1048576", "unlimited"]
    assert _limits(node, "ulimit -Sn; ulimit -Hn; ulimit -l") == expected, "root's SSH login"
    node.ssh("id sarv-limits >/dev/null 2>&1 || useradd -m -s /bin/sh sarv-limits")
    su = "su - sarv-limits -c 'ulimit -Sn; ulimit -Hn; ulimit -l'"
    assert _limits(node, su) == expected, "a user's su - session"


def test_chrony_steps_the_clock_from_the_time_server(site: Site) -> None:
    node = site.node
    assert site.skewed_by > SKEW_S - 10, f"the node's clock was {site.skewed_by:+.1f} s off, not ~{SKEW_S}"
    selected = ""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        selected = node.ssh("chronyc -n sources").stdout
        if re.search(rf"^\^\*\s+{re.escape(TIME_SERVER)}\s", selected, re.M):
            break
        time.sleep(5)
    else:
        raise AssertionError(f"chrony did not select {TIME_SERVER}:\n{selected}")
    offset = _host_offset(node)
    assert abs(offset) < 10, f"the node's clock is still {offset:+.1f} s off"
    log = node.ssh("journalctl -u chrony -b --no-pager").stdout
    assert re.search(r"System clock wrong by -?(8\d|9\d)\.\d+ seconds", log), tail(log, 30)


def test_journald_keeps_the_journal_across_a_reboot(site: Site) -> None:
    node = site.node
    machine_id = node.ssh("cat /etc/machine-id").stdout.strip()
    node.ssh(f"test -d /var/log/journal/{machine_id}")
    started = node.ssh("journalctl -u systemd-journald -b --no-pager").stdout
    assert re.search(
        rf"System Journal \(/var/log/journal/{machine_id}\) is .*max {JOURNAL_MAX[:-1]}\.0M", started
    ), tail(started, 20)
    mark = f"sarv-mark-{uuid.uuid4().hex[:12]}"
    node.ssh(f"logger -t sarv-vm-test {mark} && journalctl --flush")
    boots_before = len(node.ssh("journalctl --list-boots --no-pager").stdout.strip().splitlines())
    site.fleet.times["reboot"] = node.reboot()
    boots = node.ssh("journalctl --list-boots --no-pager").stdout.strip().splitlines()
    assert len(boots) == boots_before + 1, boots
    previous = node.ssh("journalctl -b -1 -t sarv-vm-test --no-pager").stdout
    assert mark in previous
    assert node.ssh("systemctl is-active chrony").stdout.strip() == "active"
    assert _limits(node, "ulimit -Hn; ulimit -l") == ["1048576", "unlimited"]


def test_second_run_changes_nothing(site: Site) -> None:
    out = site.fleet.playbook("idempotence", CONVERGE, timeout=1800)
    assert recap_changed(out.stdout, NODE) == 0, tail(out.stdout, 120)
