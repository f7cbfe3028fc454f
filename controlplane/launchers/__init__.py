"""Where replicas run: this host's processes (embedded default) or, later, remote hosts over SSH."""

from __future__ import annotations

import socket
from pathlib import Path

from controlplane.errors import LaunchError
from controlplane.launchers.base import Launcher, ProcessState, ReplicaProcess
from controlplane.launchers.local import LocalLauncher
from controlplane.spec import Node

__all__ = ["Launcher", "LocalLauncher", "ProcessState", "ReplicaProcess", "is_local_node", "launcher_for"]

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def is_local_node(node: Node) -> bool:
    """True for this host: a loopback address, or the node named/addressed as this host."""
    here = {socket.gethostname(), socket.getfqdn()}
    return node.address in _LOOPBACK or node.address in here or node.name in _LOOPBACK


def launcher_for(node: Node, home: Path, model_cache: Path) -> Launcher:
    """The launcher that runs replicas on ``node``."""
    if is_local_node(node):
        return LocalLauncher(home, model_cache, host="127.0.0.1")
    raise LaunchError(
        f"node {node.name} ({node.address}) is a remote host; this build can only launch on this host",
        hint="deploy with the local fleet (unset SARV_INVENTORY) until the SSH launcher is installed",
    )
