"""GPU discovery: run ``nvidia-smi`` on each node (over SSH with Fabric, or on this host) and parse it."""

from __future__ import annotations

import math
import shlex
import shutil
import socket
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from controlplane.errors import DiscoveryError
from controlplane.fleet.nvidia_smi import gpus_from_nvidia_smi, query_argv, topology_argv
from controlplane.spec import GPU, Fleet, Interconnect, Node

if TYPE_CHECKING:
    from fabric import Connection

__all__ = [
    "CommandResult",
    "Connector",
    "FabricConnector",
    "HostSession",
    "LocalConnector",
    "discover_fleet",
    "discover_node",
    "local_fleet",
    "probe_gpus",
]

_NOT_FOUND = 127  # the shell's "command not found" exit status


@dataclass(frozen=True)
class CommandResult:
    """What one command printed and how it exited."""

    exit_code: int
    stdout: str
    stderr: str


class HostSession(Protocol):
    """An open channel to one host that runs argv lists."""

    def run(self, argv: Sequence[str], *, timeout: float) -> CommandResult: ...

    def close(self) -> None: ...


class Connector(Protocol):
    """Opens a :class:`HostSession` to a node; raises :class:`DiscoveryError` when it cannot."""

    def __call__(self, node: Node, *, connect_timeout: float) -> HostSession: ...


# --- this host


class _LocalSession:
    def __init__(self, host: str) -> None:
        self._host = host

    def run(self, argv: Sequence[str], *, timeout: float) -> CommandResult:
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
        except FileNotFoundError:
            return CommandResult(_NOT_FOUND, "", f"{argv[0]}: command not found")
        except subprocess.TimeoutExpired:
            raise DiscoveryError(
                f"host {self._host}: `{shlex.join(argv)}` did not finish within {timeout:g}s",
                hint="a hung nvidia-smi usually means a wedged driver; check `dmesg` for Xid errors",
            ) from None
        return CommandResult(proc.returncode, proc.stdout, proc.stderr)

    def close(self) -> None:
        """Nothing to release: each command is its own process."""


class LocalConnector:
    """Runs the probe on this machine whatever the node (this host, or tests with a fake nvidia-smi)."""

    def __call__(self, node: Node, *, connect_timeout: float) -> HostSession:
        return _LocalSession(node.name)


# --- over SSH


class _FabricSession:
    def __init__(self, conn: Connection, host: str) -> None:
        self._conn = conn
        self._host = host

    def run(self, argv: Sequence[str], *, timeout: float) -> CommandResult:
        from invoke.exceptions import CommandTimedOut
        from paramiko import SSHException

        try:
            # hide: nothing reaches our terminal; warn: a non-zero exit is a result, not an exception;
            # in_stream=False: never read our stdin (discovery runs in parallel threads).
            result = self._conn.run(
                shlex.join(argv), hide=True, warn=True, in_stream=False, timeout=math.ceil(timeout)
            )
        except CommandTimedOut:
            raise DiscoveryError(
                f"host {self._host}: `{shlex.join(argv)}` did not finish within {timeout:g}s",
                hint="a hung nvidia-smi usually means a wedged driver; check `dmesg` for Xid errors",
            ) from None
        except (SSHException, OSError, EOFError) as exc:
            raise DiscoveryError(
                f"host {self._host}: SSH session failed while running nvidia-smi: {exc}"
            ) from None
        return CommandResult(int(result.return_code), str(result.stdout), str(result.stderr))

    def close(self) -> None:
        self._conn.close()


class FabricConnector:
    """Opens SSH connections with Fabric, as ``ansible_user``@``ansible_host``:``ansible_port`` of each node.

    ``key_filename`` restricts authentication to that private key (otherwise the agent and
    ``~/.ssh/id_*`` are tried, as ssh does). ``known_hosts`` makes unknown or changed host keys fatal;
    without it host keys are accepted on first sight, like Fabric's default and Ansible's
    ``host_key_checking = False``.
    """

    def __init__(
        self,
        *,
        key_filename: Path | None = None,
        known_hosts: Path | None = None,
        user: str | None = None,
    ) -> None:
        self.key_filename = key_filename
        self.known_hosts = known_hosts
        self.user = user

    def __call__(self, node: Node, *, connect_timeout: float) -> HostSession:
        return _FabricSession(self.connection(node, connect_timeout=connect_timeout), node.name)

    def connection(self, node: Node, *, connect_timeout: float) -> Connection:
        """An open Fabric connection to ``node`` (the launchers need files and sudo, not just argv)."""
        from fabric import Connection
        from paramiko import RejectPolicy, SSHException

        # connect_timeout only bounds the TCP connect in paramiko; a port that accepts but never
        # speaks SSH would otherwise hold a worker for the 15 s banner + 30 s auth defaults.
        connect_kwargs: dict[str, Any] = {"banner_timeout": connect_timeout, "auth_timeout": connect_timeout}
        if self.key_filename is not None:
            connect_kwargs |= {
                "key_filename": [str(self.key_filename)],
                "look_for_keys": False,
                "allow_agent": False,
            }
        user = node.ssh_user or self.user
        conn = Connection(
            host=node.address,
            user=user,
            port=node.ssh_port,
            connect_timeout=max(1, math.ceil(connect_timeout)),
            connect_kwargs=connect_kwargs,
        )
        if self.known_hosts is not None:
            conn.client.load_host_keys(str(self.known_hosts))
            conn.client.set_missing_host_key_policy(RejectPolicy())
        target = f"{conn.user}@{node.address}:{node.ssh_port}"
        try:
            conn.open()
        except (SSHException, OSError, EOFError) as exc:
            conn.close()
            reason = str(exc) or type(exc).__name__
            raise DiscoveryError(
                f"host {node.name}: cannot open SSH to {target}: {reason}",
                hint="check ansible_host/ansible_port, that sshd runs there, and the user and key "
                "(`ssh -p PORT USER@HOST nvidia-smi` by hand)",
            ) from None
        return conn


# --- probing


def probe_gpus(
    session: HostSession, host: str, *, nvidia_smi: str = "nvidia-smi", timeout: float = 60.0
) -> list[GPU]:
    """The GPUs of one host, from ``nvidia-smi --query-gpu`` and ``nvidia-smi topo -m``."""
    query = session.run(query_argv(nvidia_smi), timeout=timeout)
    if query.exit_code == _NOT_FOUND:
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
