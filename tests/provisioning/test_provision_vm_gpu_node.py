"""A GPU node's roles that need a real kernel, on one QEMU virtual machine: ``nvme_raid`` (the model cache's
RAID-0 array, its reboot) and ``nvidia_driver`` (nouveau, the initramfs, the reboot logic), converged by
``playbooks/gpu_nodes.yml`` itself, in its order.

One VM (tests/fixtures/vms.py, image from scripts/testbed-vm-image) carries five emulated NVMe drives: two
blank ones for the RAID-0 array, one with an ext4 filesystem, one with an MBR partition table and one that
gets a foreign RAID member signature. It is an air-gapped node: no Debian source, only the signed stand-in
NVIDIA mirror of the Molecule scenarios (.config/molecule/shared/fake_nvidia_mirror.yml, built and served
inside the VM). nouveau (in Debian's kernel) is loaded by hand, as on a node whose card nouveau took at
boot. What needs a GPU stays skipped by two tags: the kernel headers and DKMS
(``nvidia_driver_kernel_packages``: no Debian mirror is reachable from the VM) and loading the nvidia
modules, the persistence daemon and nvidia-smi (``nvidia_driver_gpu``). The tests run in order:

1. ``gpu_nodes.yml --tags nvme_raid,nvidia_driver`` with reboots allowed: a real md RAID-0 array, XFS
   mounted noatime by UUID, mdadm.conf; nouveau blacklisted; the initramfs rebuilt **once**, carrying both
   the array and the blacklist; the VM rebooted by Ansible's reboot module (a new boot id, nouveau gone) and
   the play going on after it (nvme_raid's handler runs after the reboot); the array assembled and mounted
   again by the initramfs that boot loaded; the pinned branch installed from
   the mirror, not the newer one it also carries;
2. the repository entry signed by the keyring, the keyring the mirror's key, apt's update clean;
3. a second run changes nothing and does not reboot;
4. a power cycle that boots the kernel and initramfs in the guest's /boot (as its boot loader would) brings
   back the array and the mount, without nouveau;
5. an initramfs older than the blacklist (a run stopped before its rebuild) is rebuilt by the next run;
   nouveau loaded again with reboots not allowed: no reboot, and the warning says what to do;
6. a repository key that is not the pinned one stops the run, naming the pinned fingerprint;
7. drives carrying a filesystem, a partition table or a RAID signature are refused and left intact, so are a
   missing drive and a file that is not a block device, and with ``nvme_raid_force`` a single drive is wiped
   and mounted without RAID (XFS, noatime, by UUID, read-ahead), with xfsprogs and not mdadm asked for.

These replaced the two roles' Molecule scenarios in containers, which could not build the array (no md
driver) and skipped everything tagged ``gpu_host``; and the two roles' separate VMs, one for each.

Molecule is not used: ansible-playbook runs against the VM's forwarded SSH port, and every reboot boots the
kernel and initramfs in the guest's own /boot, as its boot loader would (``own_boot``): Ansible's reboot
module ends QEMU, whose guest handed those files over from a shutdown hook, and the fixture starts it again
with them (:meth:`fixtures.vms.VM._watch`); step 4 powers the guest off and copies them over SSH first
(:meth:`fixtures.vms.VM.reboot`). Under Molecule's VM driver (.config/molecule/vm/), QEMU resets the guest
in place and boots the files it was started with, so a rebuilt initramfs never boots there.
``net_tuning``, which needs no initramfs, runs as a Molecule scenario on a VM (roles/net_tuning/molecule).
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fixtures.ansible import tail
from fixtures.common import REPO, need_binary
from fixtures.vms import VM, Drive, Fleet, booted_fleet, recap_changed

# In scripts/test's whole run (its VM process).
pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(2400)]

MOUNT = "/var/lib/sarv/models"
RAID = [Drive("raid0"), Drive("raid1")]


def _ext4(path: Path) -> None:
    subprocess.run([need_binary("mkfs.ext4"), "-q", "-F", "-L", "data", str(path)], check=True, timeout=60)


def _mbr(path: Path) -> None:
    """An MBR with one Linux partition entry and the boot signature (blkid: PTTYPE=dos)."""
    mbr = bytearray(512)
    mbr[446:462] = bytes([0, 0, 0, 0, 0x83, 0, 0, 0]) + struct.pack("<II", 2048, 4096)
    mbr[510:512] = b"\x55\xaa"
    with path.open("r+b") as f:
        f.write(mbr)


EXT4 = Drive("ext4", 320, _ext4)
MBR = Drive("mbr", 64, _mbr)
MDSIG = Drive("mdsig", 64)
NOT_A_DRIVE = "/root/not-a-drive.img"

PORT = 8089  # the fake mirror play's fake_mirror_port
MIRROR = f"http://127.0.0.1:{PORT}/cuda/debian12/x86_64"
SOURCE = "/etc/apt/sources.list.d/nvidia-cuda.list"
KEYRING = "/etc/apt/keyrings/nvidia-cuda.asc"
FOREIGN_KEY = "EB693B3035CD5710E231E123A4B469963BF863CC"
BLACKLIST = "/etc/modprobe.d/blacklist-nouveau.conf"
SKIP = ("--skip-tags", "nvidia_driver_kernel_packages,nvidia_driver_gpu")
REBOOT = "TASK [nvidia_driver : Reboot into the new driver]"
REBUILD = "TASK [nvidia_driver : Rebuild the initramfs without nouveau unless it is newer than the blacklist]"
INSTALL = "nvme_raid : Install mdadm and xfsprogs"
HANDLER = "RUNNING HANDLER [nvme_raid : Update the initramfs unless it is newer than mdadm.conf]"

PREPARE = f"""---
# An air-gapped node: no Debian source, only the site's (here: the stand-in NVIDIA) repositories.
- name: No upstream Debian source
  hosts: vms
  gather_facts: false
  tasks:
    - name: Remove the Debian source the image was built with
      ansible.builtin.file:
        path: /etc/apt/sources.list
        state: absent

- name: Fake NVIDIA mirror
  ansible.builtin.import_playbook: {REPO}/.config/molecule/shared/fake_nvidia_mirror.yml
  vars:
    fake_mirror_packages:
      - {{repo: cuda/debian12/x86_64, name: cuda-drivers-550, version: 550.163.01-1}}
      - {{repo: cuda/debian12/x86_64, name: cuda-drivers-570, version: 570.172.08-1}}
"""

# gpu_nodes.yml as site.yml runs it. The first play gathers the minimal fact subset the roles read (the
# distribution, for preflight and the package paths); with smart gathering (set for these runs, as in
# ansible.cfg), gpu_nodes.yml then uses those facts instead of the full set, whose hardware and network
# probes are slow processes under software emulation.
CONVERGE = f"""---
- name: Minimal facts
  hosts: gpu_nodes
  gather_facts: true
  gather_subset: [min]

- name: The GPU nodes' play
  ansible.builtin.import_playbook: {REPO}/playbooks/gpu_nodes.yml
"""


@pytest.fixture(scope="module")
def fleet(ssh_keypair: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    workdir = tmp_path_factory.mktemp("vm-gpu-node")
    with booted_fleet(workdir, ssh_keypair[0], drives=[*RAID, EXT4, MBR, MDSIG], own_boot=True) as f:
        out = f.playbook("prepare", PREPARE, env={"MOLECULE_EPHEMERAL_DIRECTORY": str(workdir)})
        assert out.returncode == 0, tail(out.stdout, 120)
        # The operator's inventory: the VM in gpu_nodes with its declared GPU facts and the two roles'
        # variables (YAML, so that lists and booleans keep their types).
        group = {
            "gpu_nodes": {
                "hosts": {f.vm.name: None},
                "vars": {
                    "sarv_gpu_model": "A100-40GB",
                    "sarv_gpu_count": 1,
                    "sarv_gpu_memory_mib": 40960,
                    "sarv_gpu_interconnect": "pcie",
                    "nvme_raid_devices": [d.guest_path for d in RAID],
                    "nvme_raid_mount_owner": "nobody",
                    "nvme_raid_mount_mode": "0750",
                    "nvidia_driver_branch": "550",
                    "nvidia_driver_repo_url": MIRROR,
                    "nvidia_driver_repo_key_url": f"{MIRROR}/key.asc",
                    "nvidia_driver_repo_key_fingerprint": _fingerprint(f),
                    "nvidia_driver_reboot_allowed": True,
                },
            }
        }
        (workdir / "gpu_nodes.yml").write_text(yaml.safe_dump(group))
        yield f


def _fingerprint(fleet: Fleet) -> str:
    return (fleet.workdir / "test-mirror.fingerprint").read_text().strip()


def _gpu_nodes(
    fleet: Fleet, name: str, *args: str, tags: str = "nvme_raid,nvidia_driver", timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """gpu_nodes.yml's roles named by ``tags`` against the VM, as an operator runs ``site.yml --tags``."""
    return fleet.playbook(
        name,
        CONVERGE,
        "-i",
        str(fleet.workdir / "gpu_nodes.yml"),
        "--tags",
        tags,
        *SKIP,
        *args,
        env={"ANSIBLE_GATHERING": "smart"},
        timeout=timeout,
    )


def _result(out: str, header: str) -> str:
    """The first result line (``ok:``, ``changed:`` …) after the task or handler ``header`` in ``out``."""
    assert header in out, tail(out, 120)
    after = out.split(header, 1)[1].splitlines()
    result = next((line for line in after if re.match(r"(ok|changed|skipping|failed|fatal):", line)), "")
    assert result, f"no result after {header}"
    return result


def _boot_id(vm: VM) -> str:
    return vm.ssh("cat /proc/sys/kernel/random/boot_id").stdout.strip()


def _nouveau_loaded(vm: VM) -> bool:
    return vm.ssh("test -d /sys/module/nouveau", check=False).returncode == 0


def _serve_mirror(vm: VM) -> None:
    """Start the stand-in mirror again after a reboot (the prepare play runs it as a transient unit, which a
    reboot ends; a real node's mirror is another host that stays up)."""
    vm.ssh(
        "systemctl is-active -q fake-nvidia-mirror || systemd-run -q --unit fake-nvidia-mirror "
        f"python3 -m http.server --bind 127.0.0.1 --directory /srv/fake-nvidia-mirror {PORT}; "
        f"for i in $(seq 60); do curl -fsS -o /dev/null {MIRROR}/InRelease && exit 0; sleep 1; done; "
        "exit 1",
        timeout=120,
    )


def _check_mounted_xfs(vm: VM, device: str, mount: str) -> str:
    """``device`` carries the XFS mounted ``noatime`` at ``mount``, listed in fstab by its UUID, with the
    model cache's read-ahead; returns the device's real path."""
    real = vm.ssh(f"readlink -f {device}").stdout.strip()
    source, fstype, options = vm.ssh(f"findmnt -n -o SOURCE,FSTYPE,OPTIONS {mount}").stdout.split()
    assert (vm.ssh(f"readlink -f {source}").stdout.strip(), fstype) == (real, "xfs")
    assert "noatime" in options.split(",")
    uuid = vm.ssh(f"blkid -s UUID -o value {device}").stdout.strip()
    fstab = [line.split() for line in vm.ssh("cat /etc/fstab").stdout.splitlines() if mount in line]
    assert fstab == [[f"UUID={uuid}", mount, "xfs", "noatime,nofail", "0", "0"]]
    assert vm.ssh(f"blockdev --getra {device}").stdout.strip() == "16384"
    return real


def _check_model_cache(vm: VM) -> None:
    detail = vm.ssh("mdadm --detail /dev/md/sarv-models").stdout
    assert re.search(r"Raid Level : raid0", detail), detail
    assert re.search(r"Raid Devices : 2", detail), detail
    members = vm.ssh("mdadm --detail --export /dev/md/sarv-models").stdout
    for d in RAID:
        member = vm.ssh(f"readlink -f {d.guest_path}").stdout.strip()
        assert member in members, members
    _check_mounted_xfs(vm, "/dev/md/sarv-models", MOUNT)
    assert vm.ssh(f"stat -c '%U %a' {MOUNT}").stdout.split() == ["nobody", "750"]
    brief = vm.ssh("mdadm --detail --brief /dev/md/sarv-models").stdout.strip()
    conf = [
        line for line in vm.ssh("cat /etc/mdadm/mdadm.conf").stdout.splitlines() if line.startswith("ARRAY")
    ]
    assert conf == [brief]
    rule = vm.ssh(
        "stat -c %a /etc/udev/rules.d/69-sarv-model-cache.rules && "
        "cat /etc/udev/rules.d/69-sarv-model-cache.rules"
    ).stdout
    assert rule.startswith("644\n"), rule
    assert 'ENV{ID_FS_LABEL}=="sarv-models"' in rule and 'ATTR{queue/read_ahead_kb}="8192"' in rule, rule


def test_fresh_vm_has_no_array(fleet: Fleet) -> None:
    """The array is not there before: what the later checks see is the roles' work."""
    vm = fleet.vm
    assert vm.ssh("test -e /dev/md/sarv-models", check=False).returncode != 0
    assert vm.ssh("grep -c . /proc/mdstat", check=False).returncode == 0  # the md driver is there
    assert vm.ssh(f"test -e {BLACKLIST}", check=False).returncode != 0


def test_converge_builds_the_cache_and_reboots_into_the_driver_with_one_initramfs(fleet: Fleet) -> None:
    vm = fleet.vm
    vm.ssh("modprobe nouveau")
    assert _nouveau_loaded(vm)
    before = _boot_id(vm)
    out = _gpu_nodes(fleet, "converge", timeout=1500)
    assert out.returncode == 0, tail(out.stdout, 120)

    # The model cache, and the packages its array needs.
    _check_model_cache(vm)
    assert [a["name"] for a in fleet.module_args("converge", INSTALL)] == [["xfsprogs", "mdadm"]]

    # The driver: rebooted by the role, nouveau gone, the play went on after the reboot (nvme_raid's
    # handler runs at the end of the roles).
    assert 0 <= out.stdout.find(REBOOT) < out.stdout.find(HANDLER), tail(out.stdout, 120)
    assert _boot_id(vm) != before, "the role did not reboot the node"
    assert not _nouveau_loaded(vm)
    _serve_mirror(vm)
    blacklist = vm.ssh(f"cat {BLACKLIST}").stdout.splitlines()
    assert "blacklist nouveau" in blacklist and "options nouveau modeset=0" in blacklist
    assert vm.ssh(f"stat -c %a {BLACKLIST}").stdout.strip() == "644"
    # The pinned branch, from the mirror, and not the newer one the mirror also carries.
    assert vm.ssh("dpkg-query -W -f '${Version}' cuda-drivers-550").stdout == "550.163.01-1"
    newer = vm.ssh("dpkg-query -W -f '${db:Status-Status}' cuda-drivers-570 2>/dev/null || true").stdout
    assert newer.strip() != "installed"
    assert MIRROR in vm.ssh("apt-cache policy cuda-drivers-550").stdout

    # One initramfs build for both roles: nvidia_driver's, before its reboot, already carried mdadm.conf,
    # and nvme_raid's handler found it newer and left it.
    assert _result(out.stdout, REBUILD).startswith("changed:")
    assert _result(out.stdout, HANDLER).startswith("ok:")
    brief = vm.ssh("mdadm --detail --brief /dev/md/sarv-models").stdout.strip()
    inner = vm.ssh(
        "rm -rf /tmp/initrd && unmkinitramfs /initrd.img /tmp/initrd && "
        "find /tmp/initrd -path '*etc/mdadm/mdadm.conf' -exec grep -h '^ARRAY' {} + && "
        "find /tmp/initrd -path '*etc/modprobe.d/blacklist-nouveau.conf' -exec cat {} +",
        timeout=300,
    ).stdout.splitlines()
    assert brief in inner and "blacklist nouveau" in inner, inner


def test_the_repository_is_signed_by_the_pinned_key(fleet: Fleet) -> None:
    vm = fleet.vm
    mode, source = vm.ssh(f"stat -c %a {SOURCE} && cat {SOURCE}").stdout.split("\n", 1)
    assert mode == "644" and "Ansible managed" in source
    assert [line for line in source.splitlines() if line.startswith("deb ")] == [
        f"deb [signed-by={KEYRING}] {MIRROR} /"
    ]
    assert vm.ssh(f"stat -c %a {KEYRING}").stdout.strip() == "644"
    keys = vm.ssh(f"gpg --show-keys --with-colons {KEYRING}").stdout.splitlines()
    assert [line.split(":")[9] for line in keys if line.startswith("fpr:")][:1] == [_fingerprint(fleet)]
    # apt refuses an unsigned or wrongly signed repository: a clean update proves the signed-by chain.
    update = vm.ssh(
        f"apt-get update -o Dir::Etc::sourcelist={SOURCE} -o Dir::Etc::sourceparts=- 2>&1", check=False
    )
    assert update.returncode == 0 and "NO_PUBKEY" not in update.stdout, update.stdout
    assert "not signed" not in update.stdout, update.stdout


def test_second_run_changes_nothing_and_does_not_reboot(fleet: Fleet) -> None:
    before = _boot_id(fleet.vm)
    out = _gpu_nodes(fleet, "idempotence")
    assert recap_changed(out.stdout, fleet.vm.name) == 0, tail(out.stdout, 120)
    assert _boot_id(fleet.vm) == before


def test_array_and_mount_survive_a_power_cycle_into_the_rebuilt_initramfs(fleet: Fleet) -> None:
    vm = fleet.vm
    before = _boot_id(vm)
    fleet.times["power cycle"] = vm.reboot()
    assert _boot_id(vm) != before
    _check_model_cache(vm)
    assert not _nouveau_loaded(vm)
    _serve_mirror(vm)


def test_a_stale_initramfs_is_rebuilt_and_a_needed_reboot_that_is_not_allowed_is_reported_not_done(
    fleet: Fleet,
) -> None:
    """The blacklist made newer than the initramfs that boots next, as a run stopped between writing one and
    rebuilding the other leaves them: this run rebuilds it although the blacklist itself does not change.
    nouveau loaded again with reboots not allowed: no reboot, and the warning says what to do."""
    vm = fleet.vm
    vm.ssh(f"touch {BLACKLIST} && test {BLACKLIST} -nt /initrd.img")
    vm.ssh("modprobe nouveau")
    before = _boot_id(vm)
    out = _gpu_nodes(
        fleet, "not-allowed", "-e", json.dumps({"nvidia_driver_reboot_allowed": False}), tags="nvidia_driver"
    )
    assert out.returncode == 0, tail(out.stdout, 120)
    assert _result(out.stdout, "TASK [nvidia_driver : Blacklist nouveau]").startswith("ok:")
    assert _result(out.stdout, REBUILD).startswith("changed:")
    assert vm.ssh(f"test /initrd.img -nt {BLACKLIST}", check=False).returncode == 0
    assert _boot_id(vm) == before
    assert _nouveau_loaded(vm)
    assert "needs a reboot to use driver" in out.stdout, tail(out.stdout, 60)
    assert "set nvidia_driver_reboot_allowed: true or reboot it" in out.stdout


def test_a_repository_key_that_is_not_the_pinned_one_is_refused(fleet: Fleet) -> None:
    """The run stops before the repository is trusted, naming the pinned fingerprint."""
    play = f"""---
- name: Refuse a repository key with the wrong fingerprint
  hosts: vms
  gather_facts: false
  tasks:
    - name: Expect the key check to fail
      block:
        - name: Run the repository step with another pinned fingerprint
          ansible.builtin.include_role:
            name: nvidia_driver
            tasks_from: repo-Debian.yml
          vars:
            nvidia_driver_repo_url: {MIRROR}
            nvidia_driver_repo_key_url: {MIRROR}/key.asc
            nvidia_driver_repo_key_fingerprint: {FOREIGN_KEY}
        - name: The key check accepted a foreign key
          ansible.builtin.fail:
            msg: the mirror's key was accepted for another fingerprint
      rescue:
        - name: Check that the refusal names the pinned fingerprint
          ansible.builtin.assert:
            that:
              - ansible_failed_result.msg is search('does not carry the pinned key {FOREIGN_KEY}')
            fail_msg: "unexpected: {{{{ ansible_failed_result.msg | default(ansible_failed_result) }}}}"
"""
    out = fleet.playbook("foreign-key", play)
    assert out.returncode == 0, tail(out.stdout, 120)
    assert "Check that the refusal names the pinned fingerprint" in out.stdout


def _refusal_play(device: str, expect: str) -> str:
    return f"""
- name: Refuse {device}
  hosts: vms
  gather_facts: false
  tasks:
    - name: Expect a refusal
      block:
        - name: Run nvme_raid on the drive
          ansible.builtin.include_role:
            name: nvme_raid
          vars:
            nvme_raid_devices: ["{device}"]
            nvme_raid_name: sarv-single
            nvme_raid_mount_path: /srv/single
        - name: The role accepted the drive
          ansible.builtin.fail:
            msg: nvme_raid accepted {device}
      rescue:
        - name: Check that the refusal names the drive and what it carries
          ansible.builtin.assert:
            that:
              - (ansible_failed_result | to_json) is search({expect!r})
            fail_msg: "unexpected: {{{{ ansible_failed_result.msg | default(ansible_failed_result) }}}}"
"""


def test_drives_with_data_are_refused_unless_forced(fleet: Fleet) -> None:
    vm = fleet.vm
    vm.ssh(
        f"mdadm --create /dev/md/other --run --force --level=1 --raid-devices=1 --metadata=1.2 --name=other "
        f"{MDSIG.guest_path} && mdadm --stop /dev/md/other"
    )
    cases = [
        (EXT4, re.escape(f"refusing to touch {EXT4.guest_path} (ext4, label data)")),
        (MBR, re.escape(f"refusing to touch {MBR.guest_path} (dos)")),
        (
            MDSIG,
            re.escape(f"refusing to touch {MDSIG.guest_path} (linux_raid_member, label ") + r"\S*other\)",
        ),
    ]
    vm.ssh(f"truncate -s 64M {NOT_A_DRIVE}")
    plays = "---\n" + "".join(_refusal_play(d.guest_path, e) for d, e in cases)
    plays += _refusal_play("/dev/nvme9n9", re.escape("/dev/nvme9n9 does not exist"))
    plays += _refusal_play(NOT_A_DRIVE, re.escape(f"{NOT_A_DRIVE} is not a block device"))
    plays += f"""
- name: Force a single drive
  hosts: vms
  gather_facts: true
  gather_subset: [min]
  roles:
    - role: nvme_raid
      vars:
        nvme_raid_devices: ["{EXT4.guest_path}"]
        nvme_raid_force: true
        nvme_raid_name: sarv-single
        nvme_raid_mount_path: /srv/single
"""
    signatures = {d.serial: vm.ssh(f"blkid -p -o export {d.guest_path}").stdout for d, _ in cases}
    out = fleet.playbook("refusals", plays)
    assert out.returncode == 0, tail(out.stdout, 120)
    # The refused drives are untouched (the forced one is checked below).
    for d in (MBR, MDSIG):
        assert vm.ssh(f"blkid -p -o export {d.guest_path}").stdout == signatures[d.serial]
    probe = vm.ssh(f"blkid -p -o export {EXT4.guest_path}").stdout.splitlines()
    assert "TYPE=xfs" in probe
    assert "LABEL=sarv-single" in probe
    single_device = _check_mounted_xfs(vm, EXT4.guest_path, "/srv/single")
    assert single_device.removeprefix("/dev/") not in vm.ssh("cat /proc/mdstat").stdout
    # No array, so no mdadm asked for (the image carries it: whether it is installed says nothing).
    assert [a["name"] for a in fleet.module_args("refusals", INSTALL)] == [["xfsprogs"]]
    # The RAID-0 model cache is still there.
    assert vm.ssh(f"findmnt -n -o FSTYPE {MOUNT}").stdout.strip() == "xfs"
