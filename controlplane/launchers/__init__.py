"""Where replicas run: this host's processes (embedded default) or remote hosts over SSH."""

from __future__ import annotations

import socket
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from controlplane.errors import LaunchError
from controlplane.launchers.base import Launcher, ProcessState, ReplicaProcess
from controlplane.launchers.local import LocalLauncher
from controlplane.spec import Node

if TYPE_CHECKING:
    from controlplane.settings import Settings

__all__ = [
    "Launcher",
    "LocalLauncher",
    "ProcessState",
    "ReplicaProcess",
    "claim_handle",
    "group_launcher_for",
    "is_local_node",
    "launcher_for",
]

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def is_local_node(node: Node) -> bool:
    """True for this host: a loopback address, or the node named/addressed as this host."""
    here = {socket.gethostname(), socket.getfqdn()}
    if node.address in _LOOPBACK and node.ssh_port != 22:
        # A forwarded SSH port on loopback (a tunnel, a container test host) is another machine.
        return False
    return node.address in _LOOPBACK or node.address in here or node.name in _LOOPBACK


def launcher_for(node: Node, home: Path, model_cache: Path, settings: Settings | None = None) -> Launcher:
    """The launcher that runs replicas on ``node``: local processes, or systemd units over SSH."""
    if is_local_node(node):
        return LocalLauncher(home, model_cache, host="127.0.0.1")
    if settings is None:
        raise LaunchError(
            f"node {node.name} ({node.address}) is a remote host and no SSH settings were given",
            hint="deploy with the local fleet (unset SARV_INVENTORY), or upgrade the caller",
        )
    from controlplane.launchers.ssh import SshLauncher
    from controlplane.remote import FabricConnector

    connector = FabricConnector(key_filename=settings.ssh_key_file, known_hosts=settings.ssh_known_hosts)
    return SshLauncher.connect(
        node,
        connector,
        python=settings.remote_python,
        remote_cache=PurePosixPath(settings.remote_model_cache),
        local_cache=model_cache,
    )


def group_launcher_for(nodes: list[Node], model_cache: Path, settings: Settings) -> Launcher:
    """The launcher for one replica whose pipeline stages span ``nodes`` (pp rank order): Ray over SSH."""
    from controlplane.launchers.ray import RayLauncher
    from controlplane.launchers.ssh import SshLauncher

    local = [n.name for n in nodes if is_local_node(n)]
    if local:
        raise LaunchError(
            f"node {local[0]} is this host; multi-node pipeline parallelism runs on remote nodes over SSH",
            hint="list the nodes by their private addresses in the inventory",
        )
    stages = []
    try:
        for node in nodes:
            launcher = launcher_for(node, settings.home, model_cache, settings)
            if not isinstance(launcher, SshLauncher):  # narrowed for mypy; remote nodes get SSH
                raise LaunchError(f"node {node.name} has no SSH launcher")
            stages.append(launcher)
    except BaseException:
        for stage in stages:
            stage.close()
        raise
    return RayLauncher(stages, ray_version=settings.ray_version, join_timeout=settings.ray_join_timeout_s)


def claim_handle(launcher: Launcher, replica_id: str) -> dict[str, str]:
    """A handle naming whatever ``launcher.start(replica_id, …)`` may have left running, built from the
    replica id alone, for ``launcher.stop``: the launcher's own ``claim`` (beside its ``start``, which names
    what it runs), or {} for a launcher whose starts cannot be found by name. It stops a replica whose
    start never handed its handle back (the deploy was killed in between)."""
    claim = getattr(launcher, "claim", None)
    return dict(claim(replica_id)) if claim is not None else {}
