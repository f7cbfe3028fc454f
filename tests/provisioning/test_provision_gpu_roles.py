"""GPU-node Ansible: static checks, preflight on the example inventory, and one Molecule scenario per role
(roles in ON_VMS have a VM module instead, MOLECULE_ON_VMS a Molecule scenario on a VM).

The Molecule tests run ``molecule test`` (destroy, create, prepare, converge, idempotence, verify,
destroy) in a role directory as a subprocess, against a Debian 12 systemd container built from the local image
``sarv-testbed:bookworm`` (scripts/testbed-image). Each run gets its own container name through
``SARV_MOLECULE_INSTANCE`` (read by .config/molecule/config.yml), so runs never collide.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from fixtures.ansible import TESTBED_IMAGE
from fixtures.ansible import ansible_env as _env
from fixtures.ansible import tail as _tail
from fixtures.ansible import venv_tool as _tool
from fixtures.common import REPO, need, need_binary
from fixtures.vms import image_dir

GPU_ROLES = [
    "preflight",
    "common",
    "net_tuning",
    "nvme_raid",
    "nvidia_driver",
    "cuda",
    "nvidia_container_toolkit",
    "docker",
    "dcgm_exporter",
]

# Roles whose container scenario was replaced by a VM scenario of the default run (scripts/test).
ON_VMS = (
    "common",  # tests/provisioning/test_provision_vm_common.py
    "nvme_raid",  # tests/provisioning/test_provision_vm_gpu_node.py
    "nvidia_driver",  # tests/provisioning/test_provision_vm_gpu_node.py
)
# Roles whose Molecule scenario runs on a QEMU VM, through the delegated driver in .config/molecule/vm/.
MOLECULE_ON_VMS = ("net_tuning",)


# --- fast checks -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("playbook", ["site.yml", "playbooks/gpu_nodes.yml"])
def test_playbook_syntax(playbook: str) -> None:
    out = subprocess.run(
        [_tool("ansible-playbook"), "--syntax-check", "-i", "inventory.example.ini", playbook],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, _tail(out.stdout + out.stderr)


def test_argument_specs_match_defaults() -> None:
    out = subprocess.run(
        [str(REPO / "scripts" / "lint-argument-specs"), *(f"roles/{r}" for r in GPU_ROLES)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_argument_spec_lint_catches_a_mismatch(tmp_path: Path) -> None:
    role = tmp_path / "demo"
    (role / "tasks").mkdir(parents=True)
    (role / "defaults").mkdir()
    (role / "meta").mkdir()
    (role / "tasks" / "main.yml").write_text("---\n[]\n")
    (role / "defaults" / "main.yml").write_text("---\ndemo_a: 1\nunprefixed: 2\n")
    (role / "meta" / "argument_specs.yml").write_text(
        "---\nargument_specs:\n  main:\n    options:\n      demo_a: {type: int}\n      demo_b: {type: str}\n"
    )
    out = subprocess.run(
        [str(REPO / "scripts" / "lint-argument-specs"), str(role)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1
    assert "demo: unprefixed is in defaults/main.yml but not in meta/argument_specs.yml" in out.stdout
    assert "demo: demo_b is in meta/argument_specs.yml but not in defaults/main.yml" in out.stdout
    assert "demo: unprefixed does not start with the role prefix 'demo_'" in out.stdout


def _preflight_on_example_inventory(tmp_path: Path, *extra_vars: str) -> subprocess.CompletedProcess[str]:
    """Run the preflight role over every host of inventory.example.ini, all of them this machine (local)."""
    playbook = tmp_path / "preflight.yml"
    playbook.write_text(
        "---\n- name: Preflight\n  hosts: all\n  gather_facts: true\n  roles:\n    - role: preflight\n"
    )
    args = [
        _tool("ansible-playbook"),
        "-i",
        str(REPO / "inventory.example.ini"),
        "-e",
        "ansible_connection=local",
        "-e",
        f"ansible_python_interpreter={sys.executable}",
        # The example fleet is declared for Debian 12 / Ubuntu / EL9; accept whatever this machine runs.
        "-e",
        '{"preflight_supported_os": {"Debian": ["11", "12", "13"], "Ubuntu": ["22.04", "24.04"]}}',
    ]
    for ev in extra_vars:
        args += ["-e", ev]
    return subprocess.run(
        [*args, str(playbook)],
        cwd=REPO,
        env=_env(ANSIBLE_ROLES_PATH=str(REPO / "roles")),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_example_inventory_passes_preflight(tmp_path: Path) -> None:
    need(Path("/etc/debian_version").exists(), "preflight on this machine needs a Debian-family OS")
    out = _preflight_on_example_inventory(tmp_path)
    assert out.returncode == 0, _tail(out.stdout + out.stderr)
    assert "failed=0" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('{"sarv_gpu_count": "eight"}', "count=eight"),
        ('{"preflight_redis_instances_per_host": 1}', "needs a multiple of 2 and at least 6"),
        ('{"nvme_raid_force": "yes"}', "nvme_raid_force must be true or false"),
    ],
)
def test_broken_inventory_is_refused(tmp_path: Path, extra: str, message: str) -> None:
    need(Path("/etc/debian_version").exists(), "preflight on this machine needs a Debian-family OS")
    out = _preflight_on_example_inventory(tmp_path, extra)
    assert out.returncode != 0
    assert message in out.stdout + out.stderr, _tail(out.stdout + out.stderr)


# --- Molecule --------------------------------------------------------------------------------------------


def _need_docker() -> None:
    docker = need_binary("docker")
    info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=60, check=False)
    need(info.returncode == 0, "the Docker daemon is not running (scripts/test starts it)")
    image = subprocess.run(
        [docker, "image", "inspect", TESTBED_IMAGE], capture_output=True, text=True, timeout=60, check=False
    )
    need(image.returncode == 0, f"{TESTBED_IMAGE} is missing (scripts/testbed-image builds it)")


def _molecule(role: str, timeout: float, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``molecule test`` in ``roles/<role>``, its output (stdout and stderr) captured."""
    return subprocess.run(
        [_tool("molecule"), "test"],
        cwd=REPO / "roles" / role,
        env=_env(**extra_env),
        # Ansible refuses a non-blocking stdin, which a child killed at a timeout (ssh, QEMU) can leave
        # behind on one this process shares.
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )


def _molecule_test(role: str, **extra_env: str) -> None:
    _need_docker()
    instance = f"sarv-{role.replace('_', '-')}-{uuid.uuid4().hex[:8]}"
    out = _molecule(role, 1500, SARV_MOLECULE_INSTANCE=instance, **extra_env)
    if out.returncode != 0:
        docker = shutil.which("docker")
        if docker:  # `molecule test` destroys on failure; make sure nothing of this run is left behind
            subprocess.run([docker, "rm", "-f", instance], capture_output=True, timeout=120, check=False)
    assert out.returncode == 0, f"molecule test failed for roles/{role}:\n{_tail(out.stdout, 120)}"


@pytest.mark.molecule
@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("role", [r for r in GPU_ROLES if r not in (*ON_VMS, *MOLECULE_ON_VMS)])
def test_molecule_scenario(role: str) -> None:
    _molecule_test(role)


@pytest.mark.molecule
@pytest.mark.vm
@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("role", MOLECULE_ON_VMS)
def test_molecule_vm_scenario(role: str, tmp_path: Path) -> None:
    """``molecule test`` with the VM driver: create boots a QEMU VM with scripts/testbed-vm, destroy stops it.
    The ephemeral directory is this test's, so the VM's disks and key never outlive it."""
    need_binary("qemu-system-x86_64")
    image_dir()
    ephemeral = tmp_path / "molecule"
    try:
        out = _molecule(role, 2200, MOLECULE_EPHEMERAL_DIRECTORY=str(ephemeral))
    finally:
        # `molecule test` destroys on failure too; a run stopped before that (a timeout) leaves it to this.
        subprocess.run(
            [REPO / "scripts" / "testbed-vm", "down", str(ephemeral / "vms")], timeout=120, check=False
        )
    rc = out.returncode
    assert rc == 0, f"molecule test failed for roles/{role}:\n{_tail(out.stdout, 150)}"
    print(_tail(out.stdout, 40))
