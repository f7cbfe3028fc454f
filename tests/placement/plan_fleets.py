"""Fleets built in code for the planner tests: the example inventory's fleet and small variants."""

from __future__ import annotations

from controlplane.spec import GPU, Fleet, Interconnect, Node


def node(
    name: str,
    model: str,
    count: int,
    memory_mib: int,
    *,
    nvlink: bool = False,
    per_switch: int = 2,
    numa_nodes: int = 1,
    labels: dict[str, str] | None = None,
    used_mib: dict[int, int] | None = None,
) -> Node:
    """A node the way the inventory loader describes one: NVLink all-to-all, or PCIe switches of
    ``per_switch`` GPUs, GPUs split over ``numa_nodes`` in index order."""
    gpus = []
    for i in range(count):
        gpus.append(
            GPU(
                index=i,
                model=model,
                memory_total_mib=memory_mib,
                memory_used_mib=(used_mib or {}).get(i, 0),
                nvlink_peers=[j for j in range(count) if j != i] if nvlink else [],
                pcie_switch=None if nvlink else f"sw{i // per_switch}",
                numa_node=i * numa_nodes // count,
            )
        )
    return Node(
        name=name,
        address=name,
        gpus=gpus,
        interconnect=Interconnect.NVLINK if nvlink else Interconnect.PCIE,
        labels=labels or {},
    )


def example_fleet() -> Fleet:
    """The fleet of inventory.example.ini."""
    return Fleet(
        nodes=[
            node("gpu-a1", "A100-SXM4-80GB", 8, 81920, nvlink=True, numa_nodes=2, labels={"tier": "prod"}),
            node("gpu-a2", "A100-SXM4-80GB", 8, 81920, nvlink=True, numa_nodes=2, labels={"tier": "prod"}),
            node("gpu-b1", "A100-PCIE-40GB", 4, 40960, per_switch=2, numa_nodes=2, labels={"tier": "prod"}),
            node("gpu-b2", "A100-PCIE-40GB", 4, 40960, per_switch=2, numa_nodes=2, labels={"tier": "prod"}),
            node("gpu-c1", "GeForce RTX 3080", 2, 10240, per_switch=1, labels={"tier": "dev"}),
            Node(name="svc-1", address="10.20.0.101"),
            Node(name="svc-2", address="10.20.0.102"),
            Node(name="svc-3", address="10.20.0.103"),
        ]
    )
