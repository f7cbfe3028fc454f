"""Property: any symmetric ``topo -m`` matrix, printed as nvidia-smi does, parses back to its own links."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.fleet import parse_topology

CODES = ["NV1", "NV2", "NV4", "NV12", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"]


@st.composite
def matrices(draw: st.DrawFn) -> tuple[int, dict[tuple[int, int], str], list[int | None]]:
    n = draw(st.integers(min_value=1, max_value=16))
    cells = {}
    for a in range(n):
        for b in range(a + 1, n):
            cells[(a, b)] = cells[(b, a)] = draw(st.sampled_from(CODES))
    numa = draw(st.lists(st.one_of(st.none(), st.integers(0, 7)), min_size=n, max_size=n))
    return n, cells, numa


def render(n: int, cells: dict[tuple[int, int], str], numa: list[int | None], nics: int) -> str:
    head = [f"GPU{i}" for i in range(n)] + [f"NIC{k}" for k in range(nics)]
    lines = ["\t" + "\t".join([*head, "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])]
    for a in range(n):
        row = [" X " if a == b else cells[(a, b)] for b in range(n)] + ["SYS"] * nics
        node = "N/A" if numa[a] is None else str(numa[a])
        lines.append(f"GPU{a}\t" + "\t".join(row) + f"\t0-15\t{node}\t\tN/A")
    for k in range(nics):
        lines.append(f"NIC{k}\t" + "\t".join(["SYS"] * n + [" X " if j == k else "PIX" for j in range(nics)]))
    return "\n".join(lines) + "\n\nLegend:\n\n  X    = Self\n"


@settings(max_examples=150, deadline=None)
@given(matrices(), st.integers(min_value=0, max_value=3))
def test_render_then_parse(
    matrix: tuple[int, dict[tuple[int, int], str], list[int | None]], nics: int
) -> None:
    n, cells, numa = matrix
    topo = parse_topology(render(n, cells, numa, nics), host="prop")
    for a in range(n):
        assert topo.nvlink_peers[a] == [b for b in range(n) if b != a and cells[(a, b)].startswith("NV")]
        assert topo.numa_node[a] == numa[a]
        for b in range(n):
            direct = a != b and cells[(a, b)] in {"PIX", "PXB"}
            # A direct PIX/PXB link always means one switch id; the ids form a partition of the GPUs.
            if direct:
                assert topo.pcie_switch[a] == topo.pcie_switch[b]
    # Switch groups are exactly the connected components of the PIX/PXB graph.
    groups: dict[str, set[int]] = {}
    for g, sw in topo.pcie_switch.items():
        groups.setdefault(sw, set()).add(g)
    for members in groups.values():
        reached = {min(members)}
        frontier = [min(members)]
        while frontier:
            a = frontier.pop()
            for b in members:
                if b not in reached and cells[(a, b)] in {"PIX", "PXB"}:
                    reached.add(b)
                    frontier.append(b)
        assert reached == members
