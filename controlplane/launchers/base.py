"""The launcher interface: where a replica runs (local processes, a remote host) and how it is stopped."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, SecretStr

from controlplane.engines.base import EngineLaunch
from controlplane.errors import LaunchError
from controlplane.weights import WeightsPolicy

__all__ = ["Launcher", "ProcessState", "ReplicaProcess", "env_file_text", "last_error_line", "write_env_file"]


class ProcessState(StrEnum):
    RUNNING = "running"
    EXITED = "exited"
    """The replica's process ended (``exit_code`` set where the launcher could learn it)."""
    GONE = "gone"
    """Nothing of it is left, or the handle is stale (its pid now belongs to another process)."""


class ReplicaProcess(BaseModel):
    """What a launcher observed about one replica's process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: ProcessState
    exit_code: int | None = None
    """Exit code of the process, or of the engine's last crash when it was restarted."""
    restarts: int = 0
    """Times the launcher restarted the engine after a crash."""
    detail: str = ""


@runtime_checkable
class Launcher(Protocol):
    """Runs engine commands on one node. Handles are plain string maps stored in ``ReplicaRecord.handle``,
    so a later ``llmctl`` process (or another host's controller) can stop what this one started."""

    name: str
    """Stored as ``handle["launcher"]``; selects the launcher that can act on a handle."""
    host: str
    """Address where the node's replicas are reachable (endpoint host)."""

    def allocate_port(self, preferred: int | None = None) -> int:
        """A free TCP port on the node; raises ``LaunchError`` if ``preferred`` is taken."""
        ...

    def ensure_weights(
        self,
        source: str,
        model: str,
        *,
        policy: WeightsPolicy,
        progress: Callable[[str], None] | None = None,
    ) -> Path:
        """Land ``source`` in the node's model cache, verified against its manifest; return its path there."""
        ...

    def start(self, replica_id: str, launch: EngineLaunch) -> dict[str, str]:
        """Start the command detached (it outlives the caller) and return its handle."""
        ...

    def poll(self, handle: dict[str, str]) -> ReplicaProcess: ...

    def stop(self, handle: dict[str, str], *, timeout: float = 30.0) -> None:
        """Stop the replica and everything it started; a stale or empty handle is a no-op."""
        ...

    def logs(self, handle: dict[str, str], *, follow: bool = False, tail: int = 200) -> Iterator[str]:
        """The replica's log lines: the last ``tail``, then new ones while it runs if ``follow``."""
        ...


def env_file_text(secret_env: dict[str, SecretStr]) -> str:
    """``KEY=VALUE`` lines for ``docker --env-file`` / systemd ``EnvironmentFile``. Both readers take values
    literally, so a newline cannot be encoded: such a secret, or a key that is not a name, is refused."""
    lines = []
    for key, value in sorted(secret_env.items()):
        text = value.get_secret_value()
        if "\n" in text or "\r" in text or not key.isidentifier():
            raise LaunchError(f"secret {key} cannot be written to an env file (bad name or a newline in it)")
        lines.append(f"{key}={text}\n")
    return "".join(lines)


def write_env_file(path: Path, secret_env: dict[str, SecretStr]) -> None:
    """Write secrets for ``docker --env-file`` / systemd ``EnvironmentFile`` (``KEY=VALUE``), mode 0600.

    The file is created 0600 before anything is written, so the secret is never world-readable, not
    even for an instant.
    """
    text = env_file_text(secret_env)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # O_CREAT's mode does not apply to an existing file
        f.write(text)


# systemd's own journal lines about a unit that say that it failed, stopped or restarts, not why.
_SYSTEMD_GENERIC = re.compile(
    r"(?:\S+\.service: (?:Failed with result|Main process exited|Control process exited|Scheduled restart job"
    r"|Start request repeated too quickly|Consumed |Deactivated successfully|Killing process))"
    r"|(?:Failed to start|Started|Stopped|Stopping|Starting) \S+\.service"
)
_ERROR_WORDS = ("error", "failed", "exception", "denied")


def last_error_line(lines: Iterable[str]) -> str:
    """The most telling line of a replica's log or journal, or '': the last line that reads like an error,
    else the last line. systemd's generic lines about the unit ("Failed with result 'exit-code'", "Failed to
    start …") are taken only when no other line reads like an error: they come after the process's own."""
    kept = [s for line in lines if (s := line.strip()) and s != "-- No entries --"]
    own = [line for line in kept if not _SYSTEMD_GENERIC.match(line)]
    for pool in (own, kept):
        for line in reversed(pool):
            if any(word in line.lower() for word in _ERROR_WORDS):
                return line[:300]
    return kept[-1][:300] if kept else ""
