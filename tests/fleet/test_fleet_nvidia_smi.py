"""nvidia-smi output samples (real layouts: tab-separated matrix, legend, NIC legend) → GPUs and topology."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.errors import DiscoveryError
from controlplane.fleet import gpus_from_nvidia_smi, parse_gpu_query, parse_topology

SAMPLES = Path(__file__).parent / "samples"


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


def gpus(name: str):
    return gpus_from_nvidia_smi(sample(f"{name}.query.csv"), sample(f"{name}.topo.txt"), host="gpu-x")


def test_a100_sxm4_8gpu_nvlink_all_to_all_and_numa_from_affinity_column() -> None:
    got = gpus("a100-sxm4-80gb-8gpu")
    assert [g.index for g in got] == list(range(8))
    assert {g.model for g in got} == {"A100-SXM4-80GB"}  # "NVIDIA " prefix dropped
    assert {g.memory_total_mib for g in got} == {81920}
    assert got[0].memory_used_mib == 4 and got[0].memory_free_mib == 81916
    assert got[0].uuid.startswith("GPU-") and got[7].pci_bus_id == "00000000:BD:00.0"
    for g in got:
        assert g.nvlink_peers == [i for i in range(8) if i != g.index]
    # DGX A100 (NPS4): GPU pairs sit on NUMA nodes 3, 1, 7, 5.
    assert [g.numa_node for g in got] == [3, 3, 1, 1, 7, 7, 5, 5]
    # NV12 hides the PCIe path between GPUs: each GPU is its own switch component.
    assert len({g.pcie_switch for g in got}) == 8


def test_h100_sxm_8gpu_nv18() -> None:
    got = gpus("h100-sxm-8gpu")
    assert {g.model for g in got} == {"H100 80GB HBM3"}
    assert {g.memory_total_mib for g in got} == {81559}
    assert all(len(g.nvlink_peers) == 7 for g in got)
    assert [g.numa_node for g in got] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_pcie_a100_4gpu_switches_and_numa() -> None:
    got = gpus("a100-pcie-40gb-4gpu")
    assert all(g.nvlink_peers == [] for g in got)
    # GPU0-1 PXB share a switch; GPU2-3 NODE (two root complexes of one socket) do not; the pairs
    # meet only over SYS. The NIC columns (PIX, PHB, NODE) say nothing about GPU switches.
    assert [g.pcie_switch for g in got] == ["pcie0", "pcie0", "pcie1", "pcie2"]
    assert [g.numa_node for g in got] == [0, 0, 1, 1]


def test_rtx3080_2gpu_phb_is_not_a_shared_switch() -> None:
    got = gpus("rtx3080-2gpu")
    assert [g.model for g in got] == ["GeForce RTX 3080"] * 2
    assert [g.memory_used_mib for g in got] == [412, 6]
    assert got[0].pcie_switch != got[1].pcie_switch
    assert [g.numa_node for g in got] == [0, 0]


def test_legacy_matrix_without_numa_column_infers_sockets_from_sys() -> None:
    got = gpus("p100-pcie-8gpu-legacy")
    assert [g.pcie_switch for g in got] == [
        "pcie0",
        "pcie0",
        "pcie1",
        "pcie1",
        "pcie2",
        "pcie2",
        "pcie3",
        "pcie3",
    ]
    assert [g.numa_node for g in got] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_nvlink_bridge_pairs_and_spaces_instead_of_tabs() -> None:
    # As pasted from a terminal (spaces), two NVLink bridges on four RTX cards, no NUMA info.
    text = (
        "        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity   GPU NUMA ID\n"
        "GPU0     X      NV4     SYS     SYS     0-31            N/A             N/A\n"
        "GPU1    NV4      X      SYS     SYS     0-31            N/A             N/A\n"
        "GPU2    SYS     SYS      X      NV4     0-31            N/A             N/A\n"
        "GPU3    SYS     SYS     NV4      X      0-31            N/A             N/A\n"
    )
    topo = parse_topology(text, host="h")
    assert topo.nvlink_peers == {0: [1], 1: [0], 2: [3], 3: [2]}
    assert set(topo.numa_node.values()) == {None}


def test_single_gpu_matrix() -> None:
    topo = parse_topology(
        "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-11\t0\t\tN/A\n", host="h"
    )
    assert topo.nvlink_peers == {0: []} and topo.numa_node == {0: 0} and topo.pcie_switch == {0: "pcie0"}


def test_no_devices_is_an_empty_host() -> None:
    assert parse_gpu_query(sample("no-devices.query.csv"), host="h") == []


@pytest.mark.parametrize(
    ("query", "needle"),
    [
        ("broken-truncated.query.csv", "got 2 at line '3, GPU-4c6d2a1e-9b0f-4e1d-8a34-7f2b9c'"),
        ("broken-wrong-columns.query.csv", "got 5"),
        ("broken-memory-units.query.csv", "memory.total '81559 MiB' is not a number"),
        ("broken-nvml-mismatch.query.csv", "Failed to initialize NVML"),
    ],
)
def test_broken_query_output_names_host_and_line(query: str, needle: str) -> None:
    with pytest.raises(DiscoveryError) as err:
        parse_gpu_query(sample(query), host="gpu-b7")
    msg = str(err.value)
    assert msg.startswith("host gpu-b7: ") and needle in msg
    assert "\n" not in msg and err.value.exit_code == 4


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("0, GPU-a, NVIDIA A100-PCIE-40GB, 0, 0, 00000000:17:00.0\n", "memory_total_mib"),
        ("0, GPU-a, NVIDIA A100-PCIE-40GB, 40960, 50000, 00000000:17:00.0\n", "exceeds"),
        ("x, GPU-a, NVIDIA A100-PCIE-40GB, 40960, 0, 00000000:17:00.0\n", "GPU index 'x'"),
        ("0, GPU-a, A, 1, 0, b\n0, GPU-b, A, 1, 0, c\n", "duplicate GPU indices"),
    ],
)
def test_impossible_query_values(text: str, needle: str) -> None:
    with pytest.raises(DiscoveryError, match=needle):
        parse_gpu_query(text, host="h")


def test_missing_matrix() -> None:
    with pytest.raises(
        DiscoveryError, match=r"host gpu-b7: `nvidia-smi topo -m` printed no GPU matrix at line 'Legend:'"
    ):
        parse_topology(sample("broken-missing-matrix.topo.txt"), host="gpu-b7")


def test_short_matrix_row_names_the_line() -> None:
    with pytest.raises(DiscoveryError, match=r"GPU2 row has 3 cells.*line 'GPU2\\tSYS\\tSYS\\t X '"):
        parse_topology(sample("broken-short-row.topo.txt"), host="gpu-b7")


def test_unknown_link_code() -> None:
    text = sample("a100-pcie-40gb-4gpu.topo.txt").replace("PXB", "QQQ", 1)
    with pytest.raises(DiscoveryError, match="unknown link 'QQQ' between GPU0 and GPU1"):
        parse_topology(text, host="h")


def test_bad_numa_affinity() -> None:
    text = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-11\tzero\t\tN/A\n"
    with pytest.raises(DiscoveryError, match="NUMA Affinity 'zero'"):
        parse_topology(text, host="h")


def test_matrix_and_gpu_list_must_agree() -> None:
    with pytest.raises(
        DiscoveryError, match=r"topo -m` lists GPUs \[0, 1\] but --query-gpu lists \[0, 1, 2, 3\]"
    ):
        gpus_from_nvidia_smi(
            sample("a100-pcie-40gb-4gpu.query.csv"), sample("rtx3080-2gpu.topo.txt"), host="h"
        )


def test_compute_capability_is_read_when_the_driver_reports_it() -> None:
    text = (
        "0, GPU-5b3c, NVIDIA H200, 143771, 0, 00000000:19:00.0, 9.0\n"
        "1, GPU-7a1d, NVIDIA H200, 143771, 0, 00000000:3B:00.0, [N/A]\n"
    )
    got = parse_gpu_query(text, host="gpu-x")
    assert [g.compute_capability for g in got] == ["9.0", None]
    assert [g.model for g in got] == ["H200", "H200"]


def test_legacy_six_field_rows_still_parse_without_a_capability() -> None:
    assert {g.compute_capability for g in gpus("a100-sxm4-80gb-8gpu")} == {None}
