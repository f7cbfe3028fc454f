"""Parsers of ``nvidia-smi --query-gpu`` CSV and the ``nvidia-smi topo -m`` matrix into GPU models."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from controlplane.errors import DiscoveryError, describe_validation_error
from controlplane.spec import GPU

__all__ = [
    "QUERY_FIELDS",
    "Topology",
    "gpus_from_nvidia_smi",
    "parse_gpu_query",
    "parse_topology",
    "query_argv",
    "topology_argv",
]

QUERY_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used", "pci.bus_id", "compute_cap")
"""Columns asked of ``nvidia-smi --query-gpu``, in the order the parser expects them."""
LEGACY_QUERY_FIELDS = QUERY_FIELDS[:-1]
"""The same without ``compute_cap``, which drivers before R510 reject as an invalid field."""

_VENDOR_PREFIX = "NVIDIA "
_NO_DEVICES = "No devices were found"
# Header cells that are not device columns. They contain spaces, so they are matched before the
# whitespace split; ``GPU NUMA ID`` must come before any rule that would split off ``GPU``.
_HEADER_TOKEN = re.compile(r"CPU Affinity|NUMA Affinity|GPU NUMA ID|\S+")
_AFFINITY_COLUMNS = {"CPU Affinity", "NUMA Affinity", "GPU NUMA ID"}
_GPU_LABEL = re.compile(r"GPU(\d+)")
_NVLINK = re.compile(r"NV(\d+)")
# Link codes of the legend: PIX/PXB share a PCIe switch, PHB/NODE share a NUMA node, SYS crosses
# sockets. SOC is what drivers before ~R384 printed for SYS.
_PCIE_CODES = {"PIX", "PXB", "PHB", "NODE", "SYS", "SOC"}
_SWITCH_CODES = {"PIX", "PXB"}
_SAME_NUMA_CODES = {"PIX", "PXB", "PHB", "NODE"}


def query_argv(nvidia_smi: str = "nvidia-smi", *, legacy: bool = False) -> list[str]:
    """The GPU inventory command, as an argv list (``legacy``: without ``compute_cap``, for old drivers)."""
    fields = LEGACY_QUERY_FIELDS if legacy else QUERY_FIELDS
    return [nvidia_smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]


def topology_argv(nvidia_smi: str = "nvidia-smi") -> list[str]:
    """The topology matrix command, as an argv list."""
    return [nvidia_smi, "topo", "-m"]


def _fail(host: str, what: str, line: str | None = None) -> DiscoveryError:
    where = f" at line {line[:120]!r}" if line is not None else ""
    return DiscoveryError(
        f"host {host}: {what}{where}",
        hint="check that the NVIDIA driver works there (`nvidia-smi` run by hand) or drop --discover",
    )


def parse_gpu_query(text: str, *, host: str) -> list[GPU]:
    """GPUs from ``nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits`` output.

    Topology fields are left empty; :func:`gpus_from_nvidia_smi` fills them from ``topo -m``.
    """
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) == 1 and lines[0].startswith(_NO_DEVICES):
        return []
    gpus: list[GPU] = []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) not in (len(QUERY_FIELDS), len(LEGACY_QUERY_FIELDS)):
            raise _fail(
                host, f"expected {len(QUERY_FIELDS)} comma-separated GPU fields, got {len(cells)}", line
            )
        index, uuid, name, total, used, bus_id = cells[:6]
        capability = cells[6] if len(cells) > len(LEGACY_QUERY_FIELDS) else ""
        # "[N/A]" (or nothing) where the driver cannot say: the generation is then found by product name.
        compute_capability = capability if re.fullmatch(r"\d{1,2}\.\d", capability) else None
        if not index.isdigit():
            raise _fail(host, f"GPU index {index!r} is not a number", line)
        if not total.isdigit():
            raise _fail(host, f"memory.total {total!r} is not a number of MiB", line)
        # memory.used reads "[N/A]" on some vGPU/MIG configurations: nothing known to be in use.
        if used.startswith("[") and used.endswith("]"):
            used = "0"
        if not used.isdigit():
            raise _fail(host, f"memory.used {used!r} is not a number of MiB", line)
        try:
            gpus.append(
                GPU(
                    index=int(index),
                    uuid=uuid,
                    model=name.removeprefix(_VENDOR_PREFIX).strip() or name,
                    memory_total_mib=int(total),
                    memory_used_mib=int(used),
                    pci_bus_id=bus_id,
                    compute_capability=compute_capability,
                )
            )
        except ValidationError as exc:
            raise _fail(host, describe_validation_error(exc, what="GPU"), line) from None
    indices = [g.index for g in gpus]
    if len(set(indices)) != len(indices):
        raise _fail(host, f"duplicate GPU indices {sorted(indices)} in nvidia-smi output")
    return sorted(gpus, key=lambda g: g.index)


@dataclass
class Topology:
    """What ``nvidia-smi topo -m`` says about each GPU, keyed by GPU index."""

    nvlink_peers: dict[int, list[int]] = field(default_factory=dict)
    pcie_switch: dict[int, str] = field(default_factory=dict)
    numa_node: dict[int, int | None] = field(default_factory=dict)


def _components(nodes: Sequence[int], edges: Sequence[tuple[int, int]]) -> list[list[int]]:
    """Connected components, each sorted, ordered by their lowest member (stable ids across runs)."""
    parent = {n: n for n in nodes}

    def find(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for n in sorted(nodes):
        groups.setdefault(find(n), []).append(n)
    return sorted(groups.values(), key=lambda g: g[0])


def _numa_cell(value: str, *, host: str, line: str) -> int | None:
    if value.isdigit():
        return int(value)
    # "N/A" on single-socket machines and VMs; a range such as "0-1" when the GPU's PCIe root is
    # not local to one node: neither pins the GPU to one NUMA node.
    if value == "N/A" or re.fullmatch(r"\d+([-,]\d+)+", value):
        return None
    raise _fail(host, f"NUMA Affinity {value!r} is neither a node number nor N/A", line)


@dataclass
class _Matrix:
    """The GPU-by-GPU cells of ``topo -m`` and the NUMA Affinity column (None when the driver omits it)."""

    cells: dict[int, dict[int, str]]
    numa: dict[int, int | None] | None


def _header(lines: list[str], host: str) -> int:
    for i, line in enumerate(lines):
        tokens = line.split()
        # The header is the only line that starts with whitespace and names GPU0 first.
        if tokens and tokens[0] == "GPU0" and line[:1].isspace():
            return i
    first = next((ln.strip() for ln in lines if ln.strip()), "")
    raise _fail(host, "`nvidia-smi topo -m` printed no GPU matrix", first)


def _check_row(host: str, gpu: int, row: dict[int, str], line: str) -> None:
    for peer, code in row.items():
        if peer == gpu and code != "X":
            raise _fail(host, f"GPU{gpu} row has {code!r} where it meets itself (expected X)", line)
        if peer != gpu and code not in _PCIE_CODES and not _NVLINK.fullmatch(code):
            raise _fail(
                host,
                f"unknown link {code!r} between GPU{gpu} and GPU{peer} "
                "(expected X, NV#, PIX, PXB, PHB, NODE or SYS)",
                line,
            )


def _read_matrix(text: str, host: str) -> _Matrix:
    lines = text.splitlines()
    at = _header(lines, host)
    header = _HEADER_TOKEN.findall(lines[at])
    devices = [h for h in header if h not in _AFFINITY_COLUMNS]
    extras = header[len(devices) :]
    gpu_cols = {i: int(m.group(1)) for i, h in enumerate(devices) if (m := _GPU_LABEL.fullmatch(h))}
    numa_col = extras.index("NUMA Affinity") if "NUMA Affinity" in extras else None

    cells: dict[int, dict[int, str]] = {}
    numa: dict[int, int | None] = {}
    for line in lines[at + 1 :]:
        tokens = line.split()
        if not tokens:
            break  # the matrix ends at the blank line before the legend
        label = _GPU_LABEL.fullmatch(tokens[0])
        if label is None:
            continue  # NIC rows
        gpu, values = int(label.group(1)), tokens[1:]
        if not len(devices) <= len(values) <= len(devices) + len(extras):
            raise _fail(
                host,
                f"GPU{gpu} row has {len(values)} cells, the header names {len(devices)} devices "
                f"and {len(extras)} affinity columns",
                line,
            )
        row = {gpu_cols[i]: v for i, v in enumerate(values[: len(devices)]) if i in gpu_cols}
        _check_row(host, gpu, row, line)
        cells[gpu] = row
        affinity = values[len(devices) :]
        numa[gpu] = (
            _numa_cell(affinity[numa_col], host=host, line=line)
            if numa_col is not None and numa_col < len(affinity)
            else None
        )

    if sorted(cells) != sorted(gpu_cols.values()):
        raise _fail(
            host,
            f"`nvidia-smi topo -m` has rows for GPUs {sorted(cells)} "
            f"but columns for GPUs {sorted(gpu_cols.values())}",
        )
    return _Matrix(cells=cells, numa=numa if numa_col is not None else None)


def parse_topology(text: str, *, host: str) -> Topology:
    """The GPU rows of ``nvidia-smi topo -m``: NVLink peers, PCIe switch groups and NUMA nodes.

    ``NV#`` cells make NVLink peers; GPUs joined by ``PIX``/``PXB`` cells share a switch (one id per
    connected component, ``pcie0``, ``pcie1`` … by lowest GPU index); the ``NUMA Affinity`` column
    gives the NUMA node, or, on drivers too old to print it, GPUs joined by anything but ``SYS`` are
    taken to share one.
    """
    matrix = _read_matrix(text, host)
    cells = matrix.cells
    indices = sorted(cells)
    pairs = [(a, b) for a in indices for b in indices if a < b]
    topo = Topology()
    for g in indices:
        topo.nvlink_peers[g] = [p for p in indices if p != g and _NVLINK.fullmatch(cells[g][p])]
    switch_edges = [(a, b) for a, b in pairs if cells[a][b] in _SWITCH_CODES]
    for n, comp in enumerate(_components(indices, switch_edges)):
        topo.pcie_switch.update(dict.fromkeys(comp, f"pcie{n}"))
    if matrix.numa is not None:
        topo.numa_node = matrix.numa
    elif any(_NVLINK.fullmatch(cells[a][b]) for a, b in pairs):
        # NVLink cells hide the PCIe path, so sockets cannot be inferred from the matrix.
        topo.numa_node = dict.fromkeys(indices)
    else:
        numa_edges = [(a, b) for a, b in pairs if cells[a][b] in _SAME_NUMA_CODES]
        for n, comp in enumerate(_components(indices, numa_edges)):
            topo.numa_node.update(dict.fromkeys(comp, n))
    return topo


def gpus_from_nvidia_smi(query_text: str, topo_text: str | None, *, host: str) -> list[GPU]:
    """GPUs of one host from both outputs; ``topo_text`` None means the GPU list alone (no topology)."""
    gpus = parse_gpu_query(query_text, host=host)
    if not gpus or topo_text is None:
        return gpus
    topo = parse_topology(topo_text, host=host)
    if sorted(topo.nvlink_peers) != [g.index for g in gpus]:
        raise _fail(
            host,
            f"`nvidia-smi topo -m` lists GPUs {sorted(topo.nvlink_peers)} "
            f"but --query-gpu lists {[g.index for g in gpus]}",
        )
    return [
        g.model_copy(
            update={
                "nvlink_peers": topo.nvlink_peers[g.index],
                "pcie_switch": topo.pcie_switch.get(g.index),
                "numa_node": topo.numa_node.get(g.index),
            }
        )
        for g in gpus
    ]
