"""GPU discovery: real processes (a fake nvidia-smi run locally) and real SSH into container test hosts."""

from __future__ import annotations

import socket
import subprocess
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
from fixtures.common import free_port

from controlplane.errors import DiscoveryError
from controlplane.fleet import declared_gpus, discover_fleet, load_fleet, local_fleet
from controlplane.remote import CommandResult, FabricConnector, HostSession, LocalConnector
from controlplane.spec import Fleet, Interconnect, Node

SAMPLES = Path(__file__).parent / "samples"


def fake_nvidia_smi(
    tmp_path: Path, name: str, query: str, topo: str = "", *, exit_code: int = 0, reject: str = ""
) -> Path:
    """A stand-in nvidia-smi: a real executable printing sample files, as the real one prints its output.

    ``reject``: a query field it does not know (as older drivers refuse ``compute_cap``).
    """
    d = tmp_path / name
    d.mkdir()
    (d / "query.csv").write_text(query)
    (d / "topo.txt").write_text(topo)
    script = d / "nvidia-smi"
    refuse = (
        f"""*{reject}*) echo 'Field "{reject}" is not a valid field to query.'; exit 2 ;;""" if reject else ""
    )
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            case "$1" in
              topo) cat '{d}/topo.txt' ;;
              {refuse}
              --query-gpu=*) cat '{d}/query.csv'; exit {exit_code} ;;
              *) echo "unexpected arguments: $*" >&2; exit 2 ;;
            esac
            """
        )
    )
    script.chmod(0o755)
    return script


def sample_pair(name: str) -> tuple[str, str]:
    return (SAMPLES / f"{name}.query.csv").read_text(), (SAMPLES / f"{name}.topo.txt").read_text()


class _Rewritten:
    def __init__(self, inner: HostSession, program: Path) -> None:
        self._inner, self._program = inner, program

    def run(self, argv: Sequence[str], *, timeout: float) -> CommandResult:
        return self._inner.run([str(self._program), *argv[1:]], timeout=timeout)

    def close(self) -> None:
        self._inner.close()


class PerNodeScripts:
    """Connector running each node's own fake nvidia-smi locally: several 'hosts' on one machine."""

    def __init__(self, scripts: dict[str, Path]) -> None:
        self.scripts = scripts

    def __call__(self, node: Node, *, connect_timeout: float) -> HostSession:
        return _Rewritten(LocalConnector()(node, connect_timeout=connect_timeout), self.scripts[node.name])


def declared_node(name: str, **kw: object) -> Node:
    gpus = declared_gpus(
        model="A100-SXM4-80GB",
        count=8,
        memory_mib=81920,
        interconnect=Interconnect.NVLINK,
        per_switch=None,
        numa_nodes=2,
    )
    return Node.model_validate(
        {"name": name, "address": "127.0.0.1", "labels": {"rack": "r9"}, "gpus": gpus, **kw}
    )


def test_discovery_replaces_declared_gpus_per_host(tmp_path: Path) -> None:
    scripts = {
        "h100": fake_nvidia_smi(tmp_path, "h100", *sample_pair("h100-sxm-8gpu")),
        "pcie": fake_nvidia_smi(tmp_path, "pcie", *sample_pair("a100-pcie-40gb-4gpu")),
        "rtx": fake_nvidia_smi(tmp_path, "rtx", *sample_pair("rtx3080-2gpu")),
    }
    fleet = Fleet(nodes=[declared_node(n) for n in scripts])
    found = discover_fleet(fleet, connector=PerNodeScripts(scripts), parallelism=2)
    h100, pcie, rtx = found.nodes
    assert [n.name for n in found.nodes] == ["h100", "pcie", "rtx"]  # order kept
    assert (
        h100.gpu_model == "H100 80GB HBM3"
        and len(h100.gpus) == 8
        and h100.interconnect is Interconnect.NVLINK
    )
    assert h100.gpus[0].uuid.startswith("GPU-")
    assert (
        pcie.gpu_model == "A100-PCIE-40GB" and len(pcie.gpus) == 4 and pcie.interconnect is Interconnect.PCIE
    )
    assert [g.pcie_switch for g in pcie.gpus] == ["pcie0", "pcie0", "pcie1", "pcie2"]
    assert rtx.labels == {"rack": "r9"}  # only GPUs and interconnect are replaced
    assert fleet.nodes[0].gpu_model == "A100-SXM4-80GB"  # the input fleet is not modified


def test_every_failing_host_is_named(tmp_path: Path) -> None:
    good = fake_nvidia_smi(tmp_path, "good", *sample_pair("rtx3080-2gpu"))
    mismatch = fake_nvidia_smi(
        tmp_path, "mismatch", (SAMPLES / "broken-nvml-mismatch.query.csv").read_text(), exit_code=18
    )
    short = fake_nvidia_smi(
        tmp_path,
        "short",
        (SAMPLES / "a100-pcie-40gb-4gpu.query.csv").read_text(),
        (SAMPLES / "broken-short-row.topo.txt").read_text(),
    )
    fleet = Fleet(nodes=[declared_node("good"), declared_node("mismatch"), declared_node("short")])
    with pytest.raises(DiscoveryError) as err:
        discover_fleet(fleet, connector=PerNodeScripts({"good": good, "mismatch": mismatch, "short": short}))
    msg = str(err.value)
    assert msg.startswith("discovery failed on 2 of 3 hosts: ")
    assert (
        "host mismatch: nvidia-smi exited with 18: Failed to initialize NVML: Driver/library version mismatch"
        in msg
    )
    assert "host short: GPU2 row has 3 cells" in msg
    assert "host good" not in msg and "\n" not in msg and err.value.exit_code == 4


def test_no_devices_and_missing_nvidia_smi(tmp_path: Path) -> None:
    empty = fake_nvidia_smi(tmp_path, "empty", "No devices were found\n", exit_code=6)
    (node,) = discover_fleet(Fleet(nodes=[declared_node("e")]), connector=PerNodeScripts({"e": empty})).nodes
    assert node.gpus == []
    with pytest.raises(
        DiscoveryError, match=r"host x: /nonexistent/nvidia-smi not found \(install the NVIDIA driver"
    ):
        discover_fleet(
            Fleet(nodes=[declared_node("x")]),
            connector=LocalConnector(),
            nvidia_smi="/nonexistent/nvidia-smi",
        )


def test_a_driver_without_compute_cap_is_asked_again_without_it(tmp_path: Path) -> None:
    """Drivers before R510 reject the whole query over the unknown field; the six others still work."""
    script = fake_nvidia_smi(tmp_path, "old", *sample_pair("p100-pcie-8gpu-legacy"), reject="compute_cap")
    (node,) = discover_fleet(
        Fleet(nodes=[declared_node("old")]), connector=PerNodeScripts({"old": script})
    ).nodes
    assert len(node.gpus) == 8 and {g.compute_capability for g in node.gpus} == {None}


def test_hung_nvidia_smi_is_bounded(tmp_path: Path) -> None:
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\nexec sleep 30\n")
    script.chmod(0o755)
    with pytest.raises(DiscoveryError, match=r"host slow: .* did not finish within 1s"):
        discover_fleet(
            Fleet(nodes=[declared_node("slow")]),
            connector=PerNodeScripts({"slow": script}),
            command_timeout=1,
        )


def test_local_fleet_uses_the_local_nvidia_smi(tmp_path: Path) -> None:
    script = fake_nvidia_smi(tmp_path, "local", *sample_pair("a100-sxm4-80gb-8gpu"))
    (node,) = local_fleet(nvidia_smi=str(script)).nodes
    assert node.address == "127.0.0.1" and len(node.gpus) == 8 and node.interconnect is Interconnect.NVLINK


def test_unreachable_host_says_what_to_check() -> None:
    port = free_port()  # nothing listens there
    node = declared_node("gone", ssh_port=port, ssh_user="sarv")
    with pytest.raises(DiscoveryError) as err:
        discover_fleet(Fleet(nodes=[node]), connector=FabricConnector(), connect_timeout=2)
    msg = str(err.value)
    assert msg.startswith(f"host gone: cannot open SSH to sarv@127.0.0.1:{port}: ")
    assert "check ansible_host/ansible_port, that sshd runs there" in msg and "\n" not in msg


def test_a_nodes_missing_private_key_is_named_before_connecting(tmp_path: Path) -> None:
    node = declared_node("keyed", ssh_port=free_port(), ssh_user="sarv")
    node = node.model_copy(update={"ssh_key_file": str(tmp_path / "nope")})
    with pytest.raises(DiscoveryError) as err:
        discover_fleet(Fleet(nodes=[node]), connector=FabricConnector(), connect_timeout=2)
    msg = str(err.value)
    assert msg.startswith(f"host keyed: its private key {tmp_path / 'nope'} (ansible_ssh_private_key_file)")
    assert "\n" not in msg


def test_a_port_that_never_speaks_ssh_is_bounded_by_connect_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        # Accepts the TCP connection (the kernel does, via the backlog) and never sends a banner.
        node = declared_node("mute", ssh_port=port, ssh_user="sarv")
        with pytest.raises(DiscoveryError, match=rf"host mute: cannot open SSH to sarv@127.0.0.1:{port}: "):
            discover_fleet(Fleet(nodes=[node]), connector=FabricConnector(), connect_timeout=1)


# --- over real SSH (container test hosts with a fake nvidia-smi, see tests/fixtures/testhosts.py)


@pytest.mark.docker
@pytest.mark.ssh
def test_discovery_over_ssh_from_an_inventory(ssh_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    h0, h1 = ssh_hosts
    h0.set_fake_gpus(*sample_pair("a100-sxm4-80gb-8gpu"))
    h1.set_fake_gpus(*sample_pair("a100-pcie-40gb-4gpu"))
    inv = tmp_path / "hosts.ini"
    inv.write_text(
        textwrap.dedent(
            f"""\
            [gpu_nodes]
            {h0.name} ansible_host=127.0.0.1 ansible_port={h0.ssh_port}
            {h1.name} ansible_host=127.0.0.1 ansible_port={h1.ssh_port}

            [gpu_nodes:vars]
            ansible_user=root
            sarv_gpu_model=L4
            sarv_gpu_count=1
            sarv_gpu_memory_mib=23034
            sarv_labels=site=test
            """
        )
    )
    fleet = load_fleet(inv)
    assert [n.gpu_model for n in fleet.nodes] == ["L4", "L4"]
    found = discover_fleet(fleet, connector=FabricConnector(key_filename=h0.key_path), connect_timeout=10)
    n0, n1 = found.nodes
    assert (n0.gpu_model, len(n0.gpus), n0.interconnect) == ("A100-SXM4-80GB", 8, Interconnect.NVLINK)
    assert [g.numa_node for g in n0.gpus] == [3, 3, 1, 1, 7, 7, 5, 5]
    assert (n1.gpu_model, len(n1.gpus), n1.interconnect) == ("A100-PCIE-40GB", 4, Interconnect.PCIE)
    assert n1.labels == {"site": "test"} and n1.ssh_port == h1.ssh_port


@pytest.mark.docker
@pytest.mark.ssh
def test_broken_output_over_ssh_names_the_host(ssh_hosts) -> None:  # type: ignore[no-untyped-def]
    h0 = ssh_hosts[0]
    h0.set_fake_gpus((SAMPLES / "broken-memory-units.query.csv").read_text(), "")
    node = Node(name=h0.name, address=h0.address, ssh_port=h0.ssh_port, ssh_user=h0.user)
    with pytest.raises(
        DiscoveryError, match=rf"host {h0.name}: memory.total '81559 MiB' is not a number of MiB"
    ):
        discover_fleet(Fleet(nodes=[node]), connector=FabricConnector(key_filename=h0.key_path))
    h0.set_fake_gpus(*sample_pair("rtx3080-2gpu"))
    (ok,) = discover_fleet(Fleet(nodes=[node]), connector=FabricConnector(key_filename=h0.key_path)).nodes
    assert ok.gpu_model == "GeForce RTX 3080"


@pytest.mark.docker
@pytest.mark.ssh
def test_ssh_refusals_are_discovery_errors(ssh_hosts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    h0 = ssh_hosts[0]
    node = Node(name=h0.name, address=h0.address, ssh_port=h0.ssh_port, ssh_user=h0.user)
    other_key = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True)
    with pytest.raises(
        DiscoveryError, match=rf"host {h0.name}: cannot open SSH to root@127.0.0.1:{h0.ssh_port}: "
    ):
        discover_fleet(Fleet(nodes=[node]), connector=FabricConnector(key_filename=other_key))
    empty_known_hosts = tmp_path / "known_hosts"
    empty_known_hosts.write_text("")
    with pytest.raises(DiscoveryError, match=r"not found in known_hosts"):
        discover_fleet(
            Fleet(nodes=[node]),
            connector=FabricConnector(key_filename=h0.key_path, known_hosts=empty_known_hosts),
        )
