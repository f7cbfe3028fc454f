"""The ``nvidia_driver`` role's reboot logic on a QEMU virtual machine: it reboots only when needed and
allowed, and the play goes on after the reboot.

A container test host cannot reboot and has no kernel modules, so the Molecule scenario skips everything
tagged ``gpu_host``. The VM (tests/fixtures/vms.py) has a real kernel: nouveau (in Debian's kernel) is
loaded by hand, as on a node whose card nouveau took at boot, and the role runs against the same signed
stand-in NVIDIA mirror as the Molecule scenario (.config/molecule/shared/fake_nvidia_mirror.yml, built and
served inside the VM). What needs a GPU stays skipped by two finer tags: the kernel headers and DKMS
(``nvidia_driver_kernel_packages``: no Debian mirror is reachable from the VM) and loading the nvidia
modules, the persistence daemon and nvidia-smi (``nvidia_driver_gpu``).

1. converge with reboots allowed: nouveau blacklisted, the initramfs regenerated with the blacklist in it,
   the VM rebooted by Ansible's reboot module (a new boot id, nouveau gone), and a task after the role ran;
   the pinned branch installed from the mirror, not the newer one it also carries;
2. the repository entry signed by the keyring, the keyring the mirror's key, apt's update clean;
3. a second run changes nothing and does not reboot;
4. nouveau loaded again with reboots not allowed: no reboot, and the warning says what to do;
5. a repository key that is not the pinned one stops the run, naming the pinned fingerprint.

This replaced the role's Molecule scenario in a container, which skipped everything tagged ``gpu_host``.

The guest reboots in place (QEMU resets it and boots the kernel and initramfs it was started with, see
``guest_reboot`` in the fixture): without a GPU, which initramfs boots changes nothing visible; the
regenerated one is checked as a file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.ansible import tail
from fixtures.common import REPO
from fixtures.vms import Fleet, booted_fleet, recap_changed

# In scripts/test's whole run (its VM process); about 6 minutes alone under software emulation.
pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(2400)]

PORT = 8089  # the fake mirror play's fake_mirror_port
MIRROR = f"http://127.0.0.1:{PORT}/cuda/debian12/x86_64"
SKIP = ("--skip-tags", "nvidia_driver_kernel_packages,nvidia_driver_gpu")

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
SOURCE = "/etc/apt/sources.list.d/nvidia-cuda.list"
KEYRING = "/etc/apt/keyrings/nvidia-cuda.asc"
FOREIGN_KEY = "EB693B3035CD5710E231E123A4B469963BF863CC"


def _converge(fingerprint: str, reboot_allowed: bool) -> str:
    return f"""---
- name: NVIDIA driver on a VM
  hosts: vms
  gather_facts: true
  gather_subset: [min]
  vars:
    nvidia_driver_branch: "550"
    nvidia_driver_repo_url: {MIRROR}
    nvidia_driver_repo_key_url: {MIRROR}/key.asc
    nvidia_driver_repo_key_fingerprint: {fingerprint}
    nvidia_driver_reboot_allowed: {str(reboot_allowed).lower()}
  roles:
    - role: nvidia_driver
  post_tasks:
    - name: Mark that the play went on after the role
      ansible.builtin.copy:
        content: "{{{{ lookup('ansible.builtin.pipe', 'date +%s%N') }}}}\\n"
        dest: /root/after-the-role
        mode: "0644"
      changed_when: false
"""


class Node:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.vm = fleet.vm

    def boot_id(self) -> str:
        return self.vm.ssh("cat /proc/sys/kernel/random/boot_id").stdout.strip()

    def nouveau_loaded(self) -> bool:
        return self.vm.ssh("test -d /sys/module/nouveau", check=False).returncode == 0

    def marker(self) -> str:
        return self.vm.ssh("cat /root/after-the-role 2>/dev/null || true").stdout.strip()

    def serve_mirror(self) -> None:
        """Start the stand-in mirror again after a reboot (the prepare play runs it as a transient unit,
        which a reboot ends; a real node's mirror is another host that stays up)."""
        self.vm.ssh(
            "systemctl is-active -q fake-nvidia-mirror || systemd-run -q --unit fake-nvidia-mirror "
            f"python3 -m http.server --bind 127.0.0.1 --directory /srv/fake-nvidia-mirror {PORT}; "
            f"for i in $(seq 60); do curl -fsS -o /dev/null {MIRROR}/InRelease && exit 0; sleep 1; done; "
            "exit 1",
            timeout=120,
        )


@pytest.fixture(scope="module")
def node(ssh_keypair: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    workdir = tmp_path_factory.mktemp("vm-nvidia")
    with booted_fleet(workdir, ssh_keypair[0], guest_reboot=True) as f:
        out = f.playbook("prepare", PREPARE, env={"MOLECULE_EPHEMERAL_DIRECTORY": str(workdir)})
        assert out.returncode == 0, tail(out.stdout, 120)
        yield Node(f)


def _fingerprint(node: Node) -> str:
    return (node.fleet.workdir / "test-mirror.fingerprint").read_text().strip()


def test_converge_reboots_a_node_running_nouveau_and_goes_on(node: Node) -> None:
    vm = node.vm
    vm.ssh("modprobe nouveau")
    assert node.nouveau_loaded()
    before = node.boot_id()
    out = node.fleet.playbook("converge", _converge(_fingerprint(node), True), *SKIP, timeout=1500)
    assert out.returncode == 0, tail(out.stdout, 120)
    assert "Reboot into the new driver" in out.stdout
    assert node.boot_id() != before, "the role did not reboot the node"
    node.serve_mirror()
    assert not node.nouveau_loaded()
    assert node.marker(), "the play did not go on after the reboot"
    blacklist = vm.ssh("cat /etc/modprobe.d/blacklist-nouveau.conf").stdout.splitlines()
    assert "blacklist nouveau" in blacklist
    kernel = vm.ssh("uname -r").stdout.strip()
    listed = vm.ssh(f"lsinitramfs /boot/initrd.img-{kernel}").stdout.split()
    assert "etc/modprobe.d/blacklist-nouveau.conf" in listed
    assert "options nouveau modeset=0" in blacklist
    assert vm.ssh("stat -c %a /etc/modprobe.d/blacklist-nouveau.conf").stdout.strip() == "644"
    # The pinned branch, from the mirror, and not the newer one the mirror also carries.
    assert vm.ssh("dpkg-query -W -f '${Version}' cuda-drivers-550").stdout == "550.163.01-1"
    newer = vm.ssh("dpkg-query -W -f '${db:Status-Status}' cuda-drivers-570 2>/dev/null || true").stdout
    assert newer.strip() != "installed"
    assert MIRROR in vm.ssh("apt-cache policy cuda-drivers-550").stdout


def test_the_repository_is_signed_by_the_pinned_key(node: Node) -> None:
    vm = node.vm
    mode, source = vm.ssh(f"stat -c %a {SOURCE} && cat {SOURCE}").stdout.split("\n", 1)
    assert mode == "644" and "Ansible managed" in source
    assert [line for line in source.splitlines() if line.startswith("deb ")] == [
        f"deb [signed-by={KEYRING}] {MIRROR} /"
    ]
    assert vm.ssh(f"stat -c %a {KEYRING}").stdout.strip() == "644"
    keys = vm.ssh(f"gpg --show-keys --with-colons {KEYRING}").stdout.splitlines()
    assert [line.split(":")[9] for line in keys if line.startswith("fpr:")][:1] == [_fingerprint(node)]
    # apt refuses an unsigned or wrongly signed repository: a clean update proves the signed-by chain.
    update = vm.ssh(
        f"apt-get update -o Dir::Etc::sourcelist={SOURCE} -o Dir::Etc::sourceparts=- 2>&1", check=False
    )
    assert update.returncode == 0 and "NO_PUBKEY" not in update.stdout, update.stdout
    assert "not signed" not in update.stdout, update.stdout


def test_second_run_changes_nothing_and_does_not_reboot(node: Node) -> None:
    before = node.boot_id()
    out = node.fleet.playbook("idempotence", _converge(_fingerprint(node), True), *SKIP)
    assert recap_changed(out.stdout, node.vm.name) == 0, tail(out.stdout, 120)
    assert node.boot_id() == before


def test_a_needed_reboot_that_is_not_allowed_is_reported_not_done(node: Node) -> None:
    node.vm.ssh("modprobe nouveau")
    before = node.boot_id()
    out = node.fleet.playbook("not-allowed", _converge(_fingerprint(node), False), *SKIP)
    assert out.returncode == 0, tail(out.stdout, 120)
    assert node.boot_id() == before
    assert node.nouveau_loaded()
    assert "needs a reboot to use driver" in out.stdout, tail(out.stdout, 60)
    assert "set nvidia_driver_reboot_allowed: true or reboot it" in out.stdout


def test_a_repository_key_that_is_not_the_pinned_one_is_refused(node: Node) -> None:
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
    node.serve_mirror()
    out = node.fleet.playbook("foreign-key", play)
    assert out.returncode == 0, tail(out.stdout, 120)
    assert "Check that the refusal names the pinned fingerprint" in out.stdout
