"""The Ansible modules of ``roles/sarv_modules``, tested on their own with stand-in tools.

``sarv_initramfs`` decides which image boots next and whether it must be rebuilt; here its tools
(``linux-version``, ``update-initramfs``, ``dracut``) are scripts that log how they were called, /boot is a
temporary directory for the functions, and the run through ansible-playbook writes nothing to this
machine's /boot. The real tools, the real image and the boot from it are tested on a VM
(``test_provision_vm_gpu_node.py``: one rebuild for nvme_raid and nvidia_driver, the stale image rebuilt).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from fixtures.ansible import ansible_env, venv_tool
from fixtures.common import REPO

LIBRARY = REPO / "roles" / "sarv_modules" / "library"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, LIBRARY / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


initramfs = _load("sarv_initramfs")


class Failed(Exception):
    pass


class FakeAnsibleModule:
    """What the module's functions use of AnsibleModule: tools found on ``path`` only, real commands."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def get_bin_path(self, name: str, required: bool = False) -> str | None:
        tool = self.path / name
        if tool.exists():
            return str(tool)
        if required:
            raise Failed(f"{name} not found")
        return None

    def run_command(
        self, argv: list[str], data: str | None = None, check_rc: bool = False
    ) -> tuple[int, str, str]:
        out = subprocess.run(argv, input=data, capture_output=True, text=True, timeout=30, check=False)
        if check_rc and out.returncode != 0:
            raise Failed(out.stderr)
        return out.returncode, out.stdout, out.stderr

    def fail_json(self, **kwargs: Any) -> None:
        raise Failed(kwargs["msg"])


def _tool(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / name).chmod(0o755)


@pytest.fixture
def debian(tmp_path: Path) -> FakeAnsibleModule:
    """linux-version as Debian's sorts: of two kernels the newest by version order (-28), where text order
    would take -9."""
    bin_dir = tmp_path / "bin"
    listed = "6.1.0-9-sarvtest\\n6.1.0-28-sarvtest\\n"
    _tool(bin_dir, "linux-version", f'if [ "$1" = list ]; then printf "{listed}"; else sort -V -r; fi')
    _tool(bin_dir, "update-initramfs", f'echo "$@" >> {tmp_path}/calls')
    return FakeAnsibleModule(bin_dir)


def test_debian_rebuilds_the_newest_installed_kernels_image(
    debian: FakeAnsibleModule, tmp_path: Path
) -> None:
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "initrd.img-6.1.0-28-sarvtest").write_text("")
    version, image, argv = initramfs.next_boot(debian, boot=str(boot))
    assert (version, image) == ("6.1.0-28-sarvtest", str(boot / "initrd.img-6.1.0-28-sarvtest"))
    assert argv == [str(debian.path / "update-initramfs"), "-u", "-k", "6.1.0-28-sarvtest"]
    # No image yet for that kernel: it is created, not updated (update-initramfs -u refuses a missing one).
    (boot / "initrd.img-6.1.0-28-sarvtest").unlink()
    assert initramfs.next_boot(debian, boot=str(boot))[2][1] == "-c"


def test_dracut_rebuilds_the_running_kernels_image(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    _tool(bin_dir, "dracut", "true")
    version, image, argv = initramfs.next_boot(FakeAnsibleModule(bin_dir), boot="/boot")
    assert version == os.uname().release
    assert image == f"/boot/initramfs-{version}.img"
    assert argv == [str(bin_dir / "dracut"), "--force", "--kver", version]


def test_no_initramfs_tool_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    with pytest.raises(Failed, match="neither update-initramfs nor dracut is installed: install"):
        initramfs.next_boot(FakeAnsibleModule(tmp_path / "bin"))


def test_only_files_newer_than_the_image_call_for_a_rebuild(tmp_path: Path) -> None:
    conf, blacklist, image = tmp_path / "mdadm.conf", tmp_path / "blacklist.conf", tmp_path / "initrd.img"
    for path, mtime in ((conf, 100), (blacklist, 300), (image, 200)):
        path.write_text("")
        os.utime(path, ns=(mtime * 10**9, mtime * 10**9))
    missing = str(tmp_path / "not-written")
    assert initramfs.newer_than_image(str(image), [str(conf)]) == []
    assert initramfs.newer_than_image(str(image), [str(conf), str(blacklist), missing]) == [str(blacklist)]
    # Written in the same instant as the image: not known to be in it, so rebuilt.
    os.utime(conf, ns=(200 * 10**9, 200 * 10**9))
    assert initramfs.newer_than_image(str(image), [str(conf)]) == [str(conf)]
    image.unlink()
    assert initramfs.newer_than_image(str(image), [str(conf), missing]) == [str(conf)]


def test_the_module_runs_under_ansible_in_check_mode_and_for_real(
    debian: FakeAnsibleModule, tmp_path: Path
) -> None:
    """Through ansible-playbook, as the roles call it (the role's library found through its name): the
    documented options are the argument spec; check mode reports the rebuild without running it; a real run
    runs the tool. This machine's /boot is not touched: the stand-in tool only logs its arguments."""
    docs = yaml.safe_load(initramfs.DOCUMENTATION)
    assert set(docs["options"]) == set(initramfs.ARGUMENT_SPEC)
    for name, spec in initramfs.ARGUMENT_SPEC.items():
        assert docs["options"][name]["type"] == spec["type"]
        assert docs["options"][name].get("required", False) == spec.get("required", False)

    conf = tmp_path / "mdadm.conf"
    conf.write_text("ARRAY /dev/md/sarv-models\n")
    play = tmp_path / "play.yml"
    play.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Rebuild",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "roles": ["sarv_modules"],
                    "tasks": [
                        {"name": "Update the initramfs", "sarv_initramfs": {"newer_than": [str(conf)]}},
                    ],
                }
            ]
        )
    )
    # The stand-in tools first on PATH, before the venv's and the system's.
    env = ansible_env(
        ANSIBLE_ROLES_PATH=str(REPO / "roles"),
        ANSIBLE_STDOUT_CALLBACK="json",
        ANSIBLE_LOCALHOST_WARNING="false",
        ANSIBLE_PYTHON_INTERPRETER=sys.executable,
    )
    env["PATH"] = f"{debian.path}:{env['PATH']}"

    def run(*extra: str) -> dict[str, Any]:
        argv = [venv_tool("ansible-playbook"), "-c", "local", "-i", "localhost,", *extra, str(play)]
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
        result: dict[str, Any] = yaml.safe_load(out.stdout)["plays"][0]["tasks"][0]["hosts"]["localhost"]
        return result

    # /boot has no image for the stand-in kernel: the module creates it.
    checked = run("--check")
    assert checked["changed"] and checked["newer"] == [str(conf)]
    assert checked["image"] == "/boot/initrd.img-6.1.0-28-sarvtest"
    assert not (tmp_path / "calls").exists()
    done = run()
    assert done["changed"]
    assert (tmp_path / "calls").read_text() == "-c -k 6.1.0-28-sarvtest\n"
