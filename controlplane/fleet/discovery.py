"""GPU discovery: run ``nvidia-smi`` on each node (over :mod:`controlplane.remote`) and parse it."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from controlplane.errors import DiscoveryError
from controlplane.fleet.nvidia_smi import gpus_from_nvidia_smi, query_argv, topology_argv
from controlplane.remote import NOT_FOUND, Connector, FabricConnector, HostSession, LocalConnector
from controlplane.spec import GPU, Fleet, Interconnect, Node

__all__ = [
    "discover_fleet",
    "discover_node",
    "local_fleet",
    "probe_gpus",
]

# --- probing


def probe_gpus(
    session: HostSession, host: str, *, nvidia_smi: str = "nvidia-smi", timeout: float = 60.0
) -> list[GPU]:
    """The GPUs of one host, from ``nvidia-smi --query-gpu`` and ``nvidia-smi topo -m``."""
    query = session.run(query_argv(nvidia_smi), timeout=timeout)
    if query.exit_code != 0 and "compute_cap" in query.stdout + query.stderr:
        # Drivers before R510 do not know the field and refuse the whole query: ask without it.
        query = session.run(query_argv(nvidia_smi, legacy=True), timeout=timeout)
    if query.exit_code == NOT_FOUND:
        raise DiscoveryError(
            f"host {host}: {nvidia_smi} not found",
            hint="install the NVIDIA driver (site.yml does), or leave the host out of --discover",
        )
    if query.exit_code != 0:
        if "No devices were found" in query.stdout:
            return []
        said = next(
            (ln.strip() for ln in (query.stdout + "\n" + query.stderr).splitlines() if ln.strip()), ""
        )
        raise DiscoveryError(
            f"host {host}: nvidia-smi exited with {query.exit_code}: {said[:200]}",
            hint="run nvidia-smi there by hand; a driver/library mismatch needs a reboot after an upgrade",
        )
    topo = session.run(topology_argv(nvidia_smi), timeout=timeout)
    if topo.exit_code != 0:
        said = next((ln.strip() for ln in (topo.stdout + "\n" + topo.stderr).splitlines() if ln.strip()), "")
        raise DiscoveryError(f"host {host}: `nvidia-smi topo -m` exited with {topo.exit_code}: {said[:200]}")
    return gpus_from_nvidia_smi(query.stdout, topo.stdout, host=host)


def _interconnect(gpus: Sequence[GPU], declared: Interconnect) -> Interconnect:
    """NVLink only when every GPU reaches every other over NVLink (partial bridges count as PCIe)."""
    if len(gpus) < 2:
        return declared if not gpus else Interconnect.PCIE
    everyone = {g.index for g in gpus}
    full = all(set(g.nvlink_peers) == everyone - {g.index} for g in gpus)
    return Interconnect.NVLINK if full else Interconnect.PCIE


def discover_node(
    node: Node,
    connector: Connector,
    *,
    connect_timeout: float = 10.0,
    command_timeout: float = 60.0,
    nvidia_smi: str = "nvidia-smi",
) -> Node:
    """``node`` with its declared GPUs replaced by what the host reports."""
    session = connector(node, connect_timeout=connect_timeout)
    try:
        gpus = probe_gpus(session, node.name, nvidia_smi=nvidia_smi, timeout=command_timeout)
    finally:
        session.close()
    return node.model_copy(update={"gpus": gpus, "interconnect": _interconnect(gpus, node.interconnect)})


def discover_fleet(
    fleet: Fleet,
    *,
    connector: Connector | None = None,
    connect_timeout: float = 10.0,
    command_timeout: float = 60.0,
    parallelism: int = 16,
    nvidia_smi: str = "nvidia-smi",
) -> Fleet:
    """Probe every node in parallel (at most ``parallelism`` at once) and return the fleet as reported.

    Every node is tried; if any fails, one :class:`DiscoveryError` names each failing host.
    """
    connector = connector if connector is not None else FabricConnector()
    if not fleet.nodes:
        return fleet.model_copy()

    def one(node: Node) -> Node | DiscoveryError:
        try:
            return discover_node(
                node,
                connector,
                connect_timeout=connect_timeout,
                command_timeout=command_timeout,
                nvidia_smi=nvidia_smi,
            )
        except DiscoveryError as exc:
            return exc

    workers = max(1, min(parallelism, len(fleet.nodes)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sarv-discover") as pool:
        results = list(pool.map(one, fleet.nodes))
    failed = [r for r in results if isinstance(r, DiscoveryError)]
    if failed:
        head = f"discovery failed on {len(failed)} of {len(results)} hosts: " if len(results) > 1 else ""
        raise DiscoveryError(head + "; ".join(e.message for e in failed), hint=failed[0].hint)
    return fleet.model_copy(update={"nodes": [r for r in results if isinstance(r, Node)]})


def local_fleet(*, nvidia_smi: str = "nvidia-smi", timeout: float = 60.0) -> Fleet:
    """This host as a one-node fleet: GPUs from a local nvidia-smi when there is one, else none."""
    node = Node(name=socket.gethostname() or "localhost", address="127.0.0.1")
    if shutil.which(nvidia_smi) is None:
        return Fleet(nodes=[node])
    return Fleet(
        nodes=[discover_node(node, LocalConnector(), command_timeout=timeout, nvidia_smi=nvidia_smi)]
    )
