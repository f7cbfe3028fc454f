"""The role that needs a real kernel for its disks, on a QEMU virtual machine: ``nvme_raid``.

One VM (tests/fixtures/vms.py, image from scripts/testbed-vm-image) carries five emulated NVMe drives: two
blank ones for the RAID-0 array, one with an ext4 filesystem, one with an MBR partition table and one that
gets a foreign RAID member signature. The tests run in order on that VM:

1. converge the role with ansible-playbook over SSH: a real md RAID-0 array, XFS mounted noatime by UUID,
   mdadm.conf and the initramfs updated;
2. a second run changes nothing;
3. a reboot (with the kernel and initramfs in the guest's /boot) brings back the array and the mount;
4. drives carrying a filesystem, a partition table or a RAID signature are refused and left intact, so are a
   missing drive and a file that is not a block device, and with ``nvme_raid_force`` a single drive is wiped
   and mounted without RAID (XFS, noatime, by UUID, read-ahead).

This replaced the role's Molecule scenario in a container, which could not build the array (no md driver)
and ran the single-drive case on a loop device of this machine.

Molecule is not used here: the reboot boots the kernel and the initramfs the role regenerated in the guest's
/boot (QEMU is started again with them, :meth:`fixtures.vms.VM.reboot`), which a reboot from inside the
guest under Molecule's VM driver (.config/molecule/vm/) does not do: QEMU keeps the kernel and initramfs it
was started with. ansible-playbook is run directly against the VM's forwarded SSH port instead.
``net_tuning``, which needs no initramfs, runs as a Molecule scenario on a VM (roles/net_tuning/molecule).
"""

from __future__ import annotations

import re
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.ansible import tail
from fixtures.common import need_binary
from fixtures.vms import VM, Drive, Fleet, booted_fleet, recap_changed

# In scripts/test's whole run (its VM process); about 6 minutes alone under software emulation.
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

CONVERGE = f"""---
- name: Model cache on a VM
  hosts: vms
  gather_facts: true
  # The role reads only os_family (nvme_raid's mdadm.conf path and initramfs handler): the minimal subset
  # saves the hardware and network probes, each a slow process under software emulation.
  gather_subset: [min]
  vars:
    nvme_raid_devices: {[d.guest_path for d in RAID]}
    nvme_raid_mount_owner: nobody
    nvme_raid_mount_mode: "0750"
  roles:
    - role: nvme_raid
"""


@pytest.fixture(scope="module")
def fleet(ssh_keypair: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with booted_fleet(tmp_path_factory.mktemp("vms"), ssh_keypair[0], drives=[*RAID, EXT4, MBR, MDSIG]) as f:
        yield f


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
    """The array is not there before: what the later checks see is the role's work."""
    vm = fleet.vm
    assert vm.ssh("test -e /dev/md/sarv-models", check=False).returncode != 0
    assert vm.ssh("grep -c . /proc/mdstat", check=False).returncode == 0  # the md driver is there


def test_converge_builds_raid0(fleet: Fleet) -> None:
    out = fleet.playbook("converge", CONVERGE)
    assert out.returncode == 0, tail(out.stdout, 120)
    assert "RUNNING HANDLER [nvme_raid : Update the initramfs (Debian family)]" in out.stdout
    vm = fleet.vm
    _check_model_cache(vm)
    # The initramfs the guest boots next carries the array, so it is assembled under its name early.
    brief = vm.ssh("mdadm --detail --brief /dev/md/sarv-models").stdout.strip()
    inner = vm.ssh(
        "rm -rf /tmp/initrd && unmkinitramfs /initrd.img /tmp/initrd && "
        "find /tmp/initrd -path '*etc/mdadm/mdadm.conf' -exec grep -h '^ARRAY' {} +",
        timeout=300,
    ).stdout
    assert brief in inner.splitlines(), inner


def test_second_run_changes_nothing(fleet: Fleet) -> None:
    out = fleet.playbook("idempotence", CONVERGE)
    assert out.returncode == 0, tail(out.stdout, 120)
    assert recap_changed(out.stdout, fleet.vm.name) == 0, tail(out.stdout, 120)


def test_array_and_mount_survive_a_reboot(fleet: Fleet) -> None:
    vm = fleet.vm
    before = vm.ssh("cat /proc/sys/kernel/random/boot_id").stdout
    fleet.times["reboot"] = vm.reboot()
    assert vm.ssh("cat /proc/sys/kernel/random/boot_id").stdout != before
    _check_model_cache(vm)


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
    # The RAID-0 model cache is still there.
    assert vm.ssh(f"findmnt -n -o FSTYPE {MOUNT}").stdout.strip() == "xfs"
