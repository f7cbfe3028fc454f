"""The launcher interface: where a replica runs (local processes, a remote host) and how it is stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from controlplane.engines.base import EngineLaunch
from controlplane.weights import WeightsPolicy

__all__ = ["Launcher", "ProcessState", "ReplicaProcess"]


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
