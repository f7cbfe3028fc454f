"""``llmctl inventory`` as a user runs it: a real subprocess, its exit code, stdout and one-line stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SAMPLES = Path(__file__).parent / "samples"
EXAMPLE = REPO / "inventory.example.ini"


def llmctl(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SARV_", "ANSIBLE_")) and k != "COLUMNS"}
    # A fixed terminal width and no user config: the output is the same on every machine.
    base.update({"COLUMNS": "200", "XDG_CONFIG_HOME": str(cwd / "config"), "HOME": str(cwd)})
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", *args],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_table_of_the_example_inventory(tmp_path: Path) -> None:
    r = llmctl("inventory", "-i", str(EXAMPLE), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = {ln.split("│")[1].strip(): ln for ln in r.stdout.splitlines() if ln.startswith("│")}
    assert sorted(rows) == ["gpu-a1", "gpu-a2", "gpu-b1", "gpu-b2", "gpu-c1"]
    assert "8 × A100-SXM4-80GB" in rows["gpu-a1"] and "NVLink all-to-all; 2 NUMA nodes" in rows["gpu-a1"]
    assert "80 GiB each" in rows["gpu-a1"] and "rack=r1,tier=prod" in rows["gpu-a1"]
    assert "2 PCIe switches (2+2); 2 NUMA nodes" in rows["gpu-b1"] and "pcie" in rows["gpu-b1"]
    assert "2 × GeForce RTX 3080" in rows["gpu-c1"] and "10 GiB each" in rows["gpu-c1"]
    assert r.stdout.rstrip().endswith("5 nodes, 26 GPUs, 1620 GiB GPU memory")


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_dump_round_trips_through_dash_i(tmp_path: Path, fmt: str) -> None:
    first = llmctl("inventory", "-i", str(EXAMPLE), "-o", fmt, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    dumped = tmp_path / f"fleet.{fmt}"
    dumped.write_text(first.stdout)
    second = llmctl("inventory", "-i", str(dumped), "-o", fmt, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    data = json.loads(first.stdout) if fmt == "json" else yaml.safe_load(first.stdout)
    assert data["version"] == 1 and len(data["nodes"]) == 5
    assert data["nodes"][0]["interconnect"] == "nvlink"


def test_sarv_inventory_is_the_default(tmp_path: Path) -> None:
    r = llmctl("inventory", "-o", "json", cwd=tmp_path, env={"SARV_INVENTORY": str(EXAMPLE)})
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["nodes"]) == 5


def test_without_inventory_this_host_is_the_fleet(tmp_path: Path) -> None:
    r = llmctl("inventory", "-o", "json", cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    (node,) = json.loads(r.stdout)["nodes"]
    assert node["address"] == "127.0.0.1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[gpu_nodes]\ngpu-7\n[gpu_nodes:vars]\nsarv_gpu_count=eight\n",
            "error: host gpu-7: sarv_gpu_count='eight' is invalid",
        ),
        (
            "[gpu_nodes]\ngpu-7 sarv_gpu_interconnect=infiniband\n",
            "error: host gpu-7: sarv_gpu_interconnect='infiniband' is invalid",
        ),
        (
            "[gpu_nodes]\ngpu-7 sarv_gpu_count=1 sarv_gpu_model=L4 sarv_gpu_memory_mib=0\n",
            "error: host gpu-7: sarv_gpu_memory_mib=0 is invalid",
        ),
        ("[gpu_nodes\ngpu-7\n", "as an Ansible inventory (as ini: "),
    ],
)
def test_bad_inventory_is_one_line_and_exit_2(tmp_path: Path, text: str, expected: str) -> None:
    inv = tmp_path / "hosts.ini"
    inv.write_text(text)
    r = llmctl("inventory", "-i", str(inv), cwd=tmp_path)
    assert r.returncode == 2
    assert expected in one_line_error(r)
    assert r.stdout == ""


def test_missing_inventory_file(tmp_path: Path) -> None:
    r = llmctl("inventory", "-i", str(tmp_path / "nope.ini"), cwd=tmp_path)
    assert r.returncode == 2
    assert "nope.ini does not exist" in one_line_error(r)


def test_inventory_without_fleet_nodes_warns(tmp_path: Path) -> None:
    inv = tmp_path / "hosts.ini"
    inv.write_text("[web]\nw1\n")
    r = llmctl("inventory", "-i", str(inv), "-o", "json", cwd=tmp_path)
    assert r.returncode == 0
    assert json.loads(r.stdout) == {"version": 1, "nodes": []}
    assert "warning: no fleet nodes in" in r.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-o", "xml"], "xml"),
        (["--connect-timeout", "0"], "greater than or equal to 0.5"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_option_is_one_line_and_exit_2(tmp_path: Path, args: list[str], needle: str) -> None:
    r = llmctl("inventory", *args, cwd=tmp_path)
    assert r.returncode == 2
    assert needle in one_line_error(r)


def test_unreachable_host_with_discover_exits_4(tmp_path: Path) -> None:
    from fixtures.common import free_port

    inv = tmp_path / "hosts.ini"
    inv.write_text(f"[gpu_nodes]\ngone ansible_host=127.0.0.1 ansible_port={free_port()} ansible_user=sarv\n")
    r = llmctl("inventory", "-i", str(inv), "--discover", "--connect-timeout", "2", cwd=tmp_path)
    assert r.returncode == 4
    assert "error: host gone: cannot open SSH to sarv@127.0.0.1:" in one_line_error(r)


@pytest.mark.docker
@pytest.mark.ssh
def test_discover_over_ssh(ssh_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    h0 = ssh_hosts[0]
    h0.set_fake_gpus(
        (SAMPLES / "h100-sxm-8gpu.query.csv").read_text(), (SAMPLES / "h100-sxm-8gpu.topo.txt").read_text()
    )
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        textwrap.dedent(
            f"""\
            gpu_nodes:
              hosts:
                {h0.name}:
                  ansible_host: 127.0.0.1
                  ansible_port: {h0.ssh_port}
                  ansible_user: root
            """
        )
    )
    r = llmctl("inventory", "-i", str(inv), "--discover", "--ssh-key", str(h0.key_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith(f"│ {h0.name}"))
    assert "8 × H100 80GB HBM3" in row and "79.6 GiB each, 8 MiB used" in row
    assert "nvlink" in row and "NVLink all-to-all; 2 NUMA nodes" in row
    # Without --ssh-key: the key deploy and the launchers use (the ssh_key_file setting), not only the
    # agent's and ~/.ssh's (HOME here has none).
    by_setting = llmctl(
        "inventory", "-i", str(inv), "--discover", "-o", "json", cwd=tmp_path,
        env={"SARV_SSH_KEY_FILE": str(h0.key_path)},
    )  # fmt: skip
    assert by_setting.returncode == 0, by_setting.stderr
    [node] = json.loads(by_setting.stdout)["nodes"]
    assert [g["model"] for g in node["gpus"]] == ["H100 80GB HBM3"] * 8
    # A host's own key (ansible_ssh_private_key_file) comes before the setting's, as in Ansible: with the
    # setting naming a key the host does not accept, discovery still gets in.
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True, timeout=60)
    with inv.open("a") as f:
        f.write(f"      ansible_ssh_private_key_file: {h0.key_path}\n")
    by_host = llmctl(
        "inventory", "-i", str(inv), "--discover", "-o", "json", cwd=tmp_path,
        env={"SARV_SSH_KEY_FILE": str(other)},
    )  # fmt: skip
    assert by_host.returncode == 0, by_host.stderr
    [node] = json.loads(by_host.stdout)["nodes"]
    assert node["ssh_key_file"] == str(h0.key_path) and len(node["gpus"]) == 8
