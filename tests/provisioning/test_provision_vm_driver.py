"""``scripts/testbed-vm``, the machine side of Molecule's VM driver: what it refuses without booting anything.

Booting, SSH and tear-down through the driver run in
``test_provision_gpu_roles.py::test_molecule_vm_scenario``. Also here: the KVM probe that every VM boot
starts with leaves its caller's standard input as it found it (Molecule runs after VM modules in one
pytest process).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.common import REPO, need_binary, stop_process
from fixtures.vms import image_dir

TESTBED_VM = REPO / "scripts" / "testbed-vm"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TESTBED_VM), *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("platforms", "says"),
    [
        ("nope", "PLATFORMS is not JSON"),
        ("[]", "a list of one or two platforms"),
        ('[{"name": "a"}, {"name": "b"}, {"name": "c"}]', "a list of one or two platforms"),
        ('[{"image": "x"}]', "each platform needs a name"),
        ('[{"name": "a", "cpus": 4}]', "platform a: unknown keys ['cpus']"),
    ],
)
def test_up_refuses_bad_platforms_in_one_line_and_creates_nothing(
    tmp_path: Path, platforms: str, says: str
) -> None:
    state = tmp_path / "vms"
    out = _run("up", str(state), platforms)
    assert out.returncode == 2, out
    assert out.stderr.startswith("testbed-vm: ") and says in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not state.exists()


def test_up_refuses_a_state_directory_whose_vms_are_up_and_down_ends_only_its_host(tmp_path: Path) -> None:
    state = tmp_path / "vms"
    state.mkdir()
    (state / "platforms.json").write_text("[]")
    # A pid file naming another process (left from before a reboot): `down` sends it nothing (this test
    # process would end) and drops the file.
    (state / "host.pid").write_text(str(os.getpid()))
    assert _run("down", str(state)).returncode == 0
    assert not (state / "host.pid").exists()
    # A process with the VM host's command line stands in for it.
    host = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "serve", str(state)], stdin=subprocess.DEVNULL
    )
    try:
        (state / "host.pid").write_text(str(host.pid))
        out = _run("up", str(state), '[{"name": "a"}]')
        assert out.returncode == 2, out
        assert f"VMs are already up in {state}; run `scripts/testbed-vm down {state}` first" in out.stderr
        assert host.poll() is None
        # `down` ends it.
        assert _run("down", str(state)).returncode == 0
        assert host.wait(timeout=30) == -signal.SIGTERM
        assert not (state / "host.pid").exists()
    finally:
        stop_process(host)


def test_down_leaves_a_directory_it_did_not_create_alone(tmp_path: Path) -> None:
    """A wrong path never loses files: without the driver's own state file, `down` touches nothing."""
    (tmp_path / "vms").mkdir()
    (tmp_path / "vms" / "keep").write_text("x")
    (tmp_path / "host.pid").write_text(str(os.getpid()))
    assert _run("down", str(tmp_path)).returncode == 0
    assert (tmp_path / "vms" / "keep").exists() and (tmp_path / "host.pid").exists()


def test_down_with_nothing_up_succeeds(tmp_path: Path) -> None:
    out = _run("down", str(tmp_path / "never-created"))
    assert (out.returncode, out.stderr) == (0, "")


def test_the_kvm_probe_leaves_the_callers_stdin_blocking() -> None:
    """The KVM probe's QEMU (serial on stdio) makes its stdin non-blocking and is killed when KVM hangs;
    had it this process's stdin, every later child would inherit a non-blocking one, which Ansible (and so
    Molecule) refuses outright."""
    need_binary("qemu-system-x86_64")
    image = image_dir()
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR))
    except OSError as e:
        pytest.skip(f"/dev/kvm does not open here ({e}): the probe starts no QEMU")
    probe = (
        "import os, sys; from pathlib import Path; from fixtures.vms import _kvm_runs; "
        f"_kvm_runs(Path({str(image)!r})); print(os.get_blocking(0))"
    )
    with open(os.devnull, "rb") as devnull:
        out = subprocess.run(
            [sys.executable, "-c", probe],
            stdin=devnull,
            capture_output=True,
            text=True,
            cwd=REPO / "tests",
            timeout=60,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", "the probe left its caller's stdin non-blocking"
