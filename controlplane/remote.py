"""The command transport to a node: argv lists run on this host (subprocess) or over SSH (Fabric).

Fleet discovery and the remote launchers both use it; it knows nothing of what runs over it.
"""

from __future__ import annotations

import math
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from controlplane.errors import DiscoveryError
from controlplane.spec import Node

if TYPE_CHECKING:
    from fabric import Connection

__all__ = [
    "NOT_FOUND",
    "CommandResult",
    "Connector",
    "FabricConnector",
    "HostSession",
    "LocalConnector",
]

NOT_FOUND = 127  # the shell's "command not found" exit status


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


def _timed_out(host: str, argv: Sequence[str], timeout: float) -> DiscoveryError:
    hung_driver = bool(argv) and Path(argv[0]).name == "nvidia-smi"
    return DiscoveryError(
        f"host {host}: `{shlex.join(argv)}` did not finish within {timeout:g}s",
        hint="a hung nvidia-smi usually means a wedged driver; check `dmesg` for Xid errors"
        if hung_driver
        else "check the host's load and the command by hand",
    )


class _LocalSession:
    def __init__(self, host: str) -> None:
        self._host = host

    def run(self, argv: Sequence[str], *, timeout: float) -> CommandResult:
        try:
            proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
        except FileNotFoundError:
            return CommandResult(NOT_FOUND, "", f"{argv[0]}: command not found")
        except subprocess.TimeoutExpired:
            raise _timed_out(self._host, argv, timeout) from None
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
            raise _timed_out(self._host, argv, timeout) from None
        except (SSHException, OSError, EOFError) as exc:
            raise DiscoveryError(
                f"host {self._host}: SSH session failed while running `{shlex.join(argv)}`: {exc}"
            ) from None
        return CommandResult(int(result.return_code), str(result.stdout), str(result.stderr))

    def close(self) -> None:
        self._conn.close()


class FabricConnector:
    """Opens SSH connections with Fabric, as ``ansible_user``@``ansible_host``:``ansible_port`` of each node.

    ``key_filename`` restricts authentication to that private key (otherwise the agent and
    ``~/.ssh/id_*`` are tried, as ssh does); a node's own key (``Node.ssh_key_file``, from its
    ``ansible_ssh_private_key_file``) takes its place for that node. ``known_hosts`` makes unknown or
    changed host keys fatal; without it host keys are accepted on first sight, like Fabric's default and
    Ansible's ``host_key_checking = False``.
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
        # The node's own key (its inventory's ansible_ssh_private_key_file) before the one for all nodes,
        # as Ansible gives a host variable precedence over --private-key.
        key = self.key_filename
        if node.ssh_key_file:
            key = Path(node.ssh_key_file)
            if not key.is_file():
                raise DiscoveryError(
                    f"host {node.name}: its private key {key} (ansible_ssh_private_key_file) is not a file",
                    hint="fix the path in the inventory, or remove the variable to use the ssh_key_file "
                    "setting",
                )
        if key is not None:
            connect_kwargs |= {
                "key_filename": [str(key)],
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
