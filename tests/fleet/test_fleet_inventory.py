"""Fleet from Ansible inventories (INI, YAML, group_vars/) and fleet files, read by ansible-core itself."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from controlplane.errors import InventoryError
from controlplane.fleet import load_fleet
from controlplane.spec import Fleet, Interconnect

REPO = Path(__file__).resolve().parents[2]

INI = """\
[a100]
h1
h2 sarv_gpu_count=4
h3 ansible_host=10.0.0.3 ansible_port=2222 ansible_user=ops

[a100:vars]
sarv_gpu_model=A100-SXM4-80GB
sarv_gpu_count=8
sarv_gpu_memory_mib=81920
sarv_gpu_interconnect=nvlink
sarv_numa_nodes=2

[cpu_only]
h4

[gpu_nodes:children]
a100
cpu_only

[gpu_nodes:vars]
# the parent group loses to the child group a100 for the interconnect, and passes the rest down
sarv_gpu_interconnect=pcie
sarv_nic=ib0
sarv_labels=tier=prod, rack=r1

[other]
svc1 ansible_port=not-a-port
lone sarv_gpu_model="GeForce RTX 3080" sarv_gpu_count=1 sarv_gpu_memory_mib=10240

[all:vars]
sarv_nic=eth0
sarv_gpu_interconnect=pcie
ansible_user=sarv
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_ini_groups_children_and_precedence(tmp_path: Path) -> None:
    fleet = load_fleet(write(tmp_path, "hosts.ini", INI))
    by_name = {n.name: n for n in fleet.nodes}
    assert sorted(by_name) == ["h1", "h2", "h3", "h4", "lone"]  # svc1 is not a GPU host
    h1, h2, h3, h4, lone = (by_name[k] for k in sorted(by_name))

    assert h1.groups == ["a100", "gpu_nodes"]
    assert len(h1.gpus) == 8 and h1.gpu_model == "A100-SXM4-80GB"
    assert h1.interconnect is Interconnect.NVLINK  # child group a100 beats parent gpu_nodes
    assert h1.nic == "ib0"  # gpu_nodes beats all
    assert h1.labels == {"tier": "prod", "rack": "r1"}
    assert h1.address == "h1" and h1.ssh_user == "sarv" and h1.ssh_port == 22
    assert [g.numa_node for g in h1.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert h1.gpus[3].nvlink_peers == [0, 1, 2, 4, 5, 6, 7]

    assert len(h2.gpus) == 4  # host var beats group var
    assert [g.numa_node for g in h2.gpus] == [0, 0, 1, 1]
    assert (h3.address, h3.ssh_port, h3.ssh_user) == ("10.0.0.3", 2222, "ops")

    assert h4.gpus == [] and h4.groups == ["cpu_only", "gpu_nodes"]  # member of gpu_nodes, nothing declared
    assert lone.groups == ["other"] and lone.gpu_model == "GeForce RTX 3080"
    assert lone.nic == "eth0" and lone.interconnect is Interconnect.PCIE
    assert lone.gpus[0].pcie_switch == "pcie0"


def test_yaml_inventory_with_group_vars_dir_and_irregular_host(tmp_path: Path) -> None:
    inv = write(
        tmp_path,
        "inv/hosts.yml",
        """\
        all:
          vars:
            base_count: 4
          children:
            gpu_nodes:
              vars:
                sarv_gpu_model: A100-PCIE-40GB
                sarv_gpu_memory_mib: 40960
                sarv_gpu_count: "{{ base_count * 2 }}"
                sarv_gpus_per_pcie_switch: 4
              hosts:
                p1: {}
                p2:
                  sarv_labels: {tier: dev, "gpu": mixed}
                  sarv_gpus:
                    - {model: A100-PCIE-40GB, memory_total_mib: 40960}
                    - {model: Tesla V100-PCIE-16GB, memory_total_mib: 16384, numa_node: 1}
            web:
              hosts:
                w1:
        """,
    )
    write(tmp_path, "inv/group_vars/gpu_nodes.yml", "sarv_nic: ens6f0\nsarv_numa_nodes: 2\n")
    write(tmp_path, "inv/host_vars/p1.yml", "ansible_port: 2200\n")
    fleet = load_fleet(inv)
    p1, p2 = fleet.nodes
    assert len(p1.gpus) == 8  # the Jinja expression is templated the way Ansible would
    assert [g.pcie_switch for g in p1.gpus] == ["pcie0"] * 4 + ["pcie1"] * 4
    assert p1.nic == "ens6f0" and p1.ssh_port == 2200  # group_vars/ and host_vars/ next to the inventory
    assert [g.model for g in p2.gpus] == ["A100-PCIE-40GB", "Tesla V100-PCIE-16GB"]
    assert [g.index for g in p2.gpus] == [0, 1]
    assert [g.numa_node for g in p2.gpus] == [None, 1]  # given for one GPU: nothing invented for the other
    assert p2.labels == {"tier": "dev", "gpu": "mixed"}


def test_the_example_inventory() -> None:
    fleet = load_fleet(REPO / "inventory.example.ini")
    by_name = {n.name: n for n in fleet.nodes}
    assert sorted(by_name) == ["gpu-a1", "gpu-a2", "gpu-b1", "gpu-b2", "gpu-c1"]
    a1, b1, c1 = by_name["gpu-a1"], by_name["gpu-b1"], by_name["gpu-c1"]
    assert (a1.address, a1.ssh_user, a1.nic) == ("10.20.0.11", "sarv", "ib0")
    assert len(a1.gpus) == 8 and a1.interconnect is Interconnect.NVLINK
    assert [g.pcie_switch for g in b1.gpus] == ["pcie0", "pcie0", "pcie1", "pcie1"]
    assert [g.numa_node for g in b1.gpus] == [0, 0, 1, 1]
    assert [g.pcie_switch for g in c1.gpus] == ["pcie0", "pcie1"]
    assert c1.gpu_model == "GeForce RTX 3080" and c1.labels == {"tier": "dev"}
    assert sum(len(n.gpus) for n in fleet.nodes) == 26


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_fleet_file_round_trip(tmp_path: Path, suffix: str) -> None:
    fleet = load_fleet(REPO / "inventory.example.ini")
    data = fleet.model_dump(mode="json")
    text = json.dumps(data) if suffix == ".json" else yaml.safe_dump(data)
    again = load_fleet(write(tmp_path, f"fleet{suffix}", text))
    assert again == fleet


def test_fleet_file_errors_are_one_line(tmp_path: Path) -> None:
    bad = {"version": 1, "nodes": [{"name": "a", "address": "x"}, {"name": "a", "address": "y"}]}
    with pytest.raises(InventoryError, match="duplicate node names: a") as err:
        load_fleet(write(tmp_path, "fleet.json", json.dumps(bad)))
    assert "\n" not in str(err.value)
    with pytest.raises(InventoryError, match=r"version: Input should be less than or equal to 1"):
        load_fleet(write(tmp_path, "fleet.yaml", "version: 2\nnodes: []\n"))
    gpu = {"index": 0, "model": "A100", "memory_total_mib": 0}
    with pytest.raises(InventoryError, match=r"nodes\.0\.gpus\.0\.memory_total_mib"):
        load_fleet(
            write(
                tmp_path, "f.yml", yaml.safe_dump({"nodes": [{"name": "a", "address": "b", "gpus": [gpu]}]})
            )
        )


@pytest.mark.parametrize(
    ("line", "var", "allowed"),
    [
        ("sarv_gpu_count=eight", "sarv_gpu_count='eight'", "a whole number from 0 to 64"),
        ("sarv_gpu_count=65", "sarv_gpu_count=65", "a whole number from 0 to 64"),
        ("sarv_gpu_interconnect=infiniband", "sarv_gpu_interconnect='infiniband'", "nvlink or pcie"),
        ("sarv_gpu_memory_mib=0", "sarv_gpu_memory_mib=0", "MiB above 0"),
        ("sarv_numa_nodes=0", "sarv_numa_nodes=0", "from 1 to 64"),
        ("sarv_labels=tier", "sarv_labels='tier'", "key=value"),
        ("ansible_port=70000", "ansible_port=70000", "from 1 to 65535"),
        ("sarv_gpu_compute_capability=sm86", "sarv_gpu_compute_capability='sm86'", "MAJOR.MINOR, e.g. 8.6"),
    ],
)
def test_bad_group_var_names_host_variable_and_allowed_values(
    tmp_path: Path, line: str, var: str, allowed: str
) -> None:
    inv = write(
        tmp_path,
        "hosts.ini",
        f"""\
        [gpu_nodes]
        gpu-7

        [gpu_nodes:vars]
        sarv_gpu_model=A100-SXM4-80GB
        sarv_gpu_count=8
        sarv_gpu_memory_mib=81920
        {line}
        """,
    )
    with pytest.raises(InventoryError) as err:
        load_fleet(inv)
    msg = str(err.value)
    assert msg.startswith(f"host gpu-7: {var} is invalid") and allowed in msg
    assert "\n" not in msg and err.value.exit_code == 2


def test_host_line_values_are_typed_too(tmp_path: Path) -> None:
    # On host lines Ansible evaluates literals (8 is an int) but a bare word stays a string.
    inv = write(
        tmp_path,
        "hosts",
        "g1 sarv_gpu_count=8 sarv_gpu_model=L4 sarv_gpu_memory_mib=23034\ng2 sarv_gpu_count=eight\n",
    )
    with pytest.raises(InventoryError, match="host g2: sarv_gpu_count='eight' is invalid"):
        load_fleet(inv)


def test_declared_compute_capability_reaches_every_gpu(tmp_path: Path) -> None:
    inv = write(
        tmp_path,
        "hosts",
        "g1 sarv_gpu_count=2 sarv_gpu_model=L4 sarv_gpu_memory_mib=23034 sarv_gpu_compute_capability=8.9\n",
    )
    (node,) = load_fleet(inv).nodes
    assert [g.compute_capability for g in node.gpus] == ["8.9", "8.9"]


def test_count_without_model_says_what_is_missing(tmp_path: Path) -> None:
    inv = write(tmp_path, "hosts.ini", "[gpu_nodes]\ng1 sarv_gpu_count=2\n")
    with pytest.raises(
        InventoryError, match="host g1: sarv_gpu_count=2 needs sarv_gpu_model and sarv_gpu_memory_mib"
    ):
        load_fleet(inv)


def test_bad_irregular_gpu_entry(tmp_path: Path) -> None:
    inv = write(
        tmp_path,
        "hosts.yml",
        """\
        gpu_nodes:
          hosts:
            odd:
              sarv_gpus:
                - {model: A100-PCIE-40GB, memory_total_mib: 40960}
                - {memory_total_mib: 16384}
        """,
    )
    with pytest.raises(InventoryError, match=r"host odd: sarv_gpus\[1\] is invalid: model: Field required"):
        load_fleet(inv)


def test_undefined_template_variable(tmp_path: Path) -> None:
    inv = write(tmp_path, "hosts.yml", "gpu_nodes:\n  hosts:\n    t1:\n      sarv_gpu_count: '{{ nope }}'\n")
    with pytest.raises(InventoryError, match="host t1: cannot template sarv_gpu_count"):
        load_fleet(inv)


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("hosts.ini", "[gpu_nodes\ng1\n", "as an Ansible inventory (as ini:"),
        ("hosts.yml", "all:\n  hosts: [a, b\n", "as yaml: YAML parsing failed"),
        ("hosts.yml", "- just\n- a list\n", "as yaml:"),
    ],
)
def test_unparseable_inventory_is_an_inventory_error(
    tmp_path: Path, name: str, text: str, needle: str
) -> None:
    with pytest.raises(InventoryError, match=r"cannot read .* as an Ansible inventory") as err:
        load_fleet(write(tmp_path, name, text))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_missing_inventory(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match=r"inventory .*nope\.ini does not exist"):
        load_fleet(tmp_path / "nope.ini")


def test_this_host_without_nvidia_smi() -> None:
    fleet = load_fleet(None)
    (node,) = fleet.nodes
    assert node.address == "127.0.0.1" and node.name
    assert isinstance(fleet, Fleet)


def test_a_hosts_private_key_is_read_as_ansible_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ansible_ssh_private_key_file`` (or ``ansible_private_key_file``) per host: ``~`` expanded, a
    relative path taken from the working directory, kept absolute in the fleet (the controller reads it
    later, from elsewhere)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    inv = tmp_path / "hosts.ini"
    inv.write_text(
        "[gpu_nodes]\n"
        "a ansible_ssh_private_key_file=~/.ssh/site_a\n"
        "b ansible_private_key_file=keys/site_b\n"
        "c\n"
    )
    nodes = {n.name: n for n in load_fleet(inv).nodes}
    assert nodes["a"].ssh_key_file == str(tmp_path / "home" / ".ssh" / "site_a")
    assert nodes["b"].ssh_key_file == str(tmp_path / "keys" / "site_b")
    assert nodes["c"].ssh_key_file is None
    # A fleet file keeps it.
    again = Fleet.model_validate_json(Fleet(nodes=list(nodes.values())).model_dump_json())
    assert {n.name: n.ssh_key_file for n in again.nodes} == {k: v.ssh_key_file for k, v in nodes.items()}
