"""Prometheus ``file_sd`` target files (JSON) from :class:`~controlplane.spec.ReplicaRecord` lists.

Prometheus watches the file and picks up changes itself (no reload), so the controller only has to
rewrite it whenever replicas change. Writes are atomic (temporary file, fsync, rename in the same
directory): Prometheus must never read a half-written file, or it drops every target in it until the next
change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from controlplane._files import write_atomic
from controlplane.errors import ConfigError, StateError
from controlplane.spec import ReplicaRecord, ReplicaState

__all__ = [
    "SCRAPED_STATES",
    "TargetGroup",
    "replica_target_groups",
    "write_file_sd",
    "write_replica_targets",
]

SCRAPED_STATES = frozenset(
    {ReplicaState.STARTING, ReplicaState.READY, ReplicaState.UNHEALTHY, ReplicaState.FAILED}
)
"""States whose replicas have (or had) an engine at their endpoint: unhealthy ones stay to show why, and a
failed (crashed, awaiting its restart) one stays a target so its ``up == 0`` raises SarvReplicaDown rather
than dropping out of monitoring."""

_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_PROMETHEUS_METRICS_PATH = "/metrics"
"""The path Prometheus scrapes when a target sets no ``__metrics_path__`` (its own default)."""


class TargetGroup(BaseModel):
    """One entry of a ``file_sd`` file: ``{"targets": ["host:port"], "labels": {…}}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    targets: list[str] = Field(min_length=1)
    """``host:port`` addresses (no scheme, no path: those are ``__scheme__``/``__metrics_path__``)."""
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _label_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _LABEL_RE.match(name):
                raise ValueError(f"{name!r} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)")
        return v


def _target(replica: ReplicaRecord) -> tuple[str, dict[str, str]] | None:
    if replica.endpoint is None or replica.state not in SCRAPED_STATES:
        return None
    url = urlsplit(replica.endpoint)
    if url.scheme not in {"http", "https"} or not url.hostname:
        raise StateError(
            f"replica {replica.id} has endpoint {replica.endpoint!r}, not an http(s) URL",
            hint="the stored replica record is inconsistent; redeploy it to record a base URL",
        )
    port = url.port or (443 if url.scheme == "https" else 80)
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    meta: dict[str, str] = {}
    if url.scheme == "https":
        meta["__scheme__"] = "https"
    # The engine's metrics path is relative to the host's root, whatever the endpoint's path.
    if replica.probes.metrics != _PROMETHEUS_METRICS_PATH:
        meta["__metrics_path__"] = replica.probes.metrics
    return f"{host}:{port}", meta


def replica_target_groups(replicas: Iterable[ReplicaRecord]) -> list[TargetGroup]:
    """One target group per scrapeable replica, sorted by replica id so the file is stable.

    Labels avoid vLLM's own series labels (``model_name``, ``engine``): a target label with the same name
    would rename the scraped one to ``exported_*``.
    """
    groups: list[TargetGroup] = []
    for replica in sorted(replicas, key=lambda r: r.id):
        found = _target(replica)
        if found is None:
            continue
        address, meta = found
        labels = {
            "deployment": replica.deployment,
            "replica": replica.id,
            "model": replica.model,
            "node": replica.node,
            "engine_kind": replica.engine.value,
            **meta,
        }
        groups.append(TargetGroup(targets=[address], labels=labels))
    return groups


def write_file_sd(path: Path, groups: Sequence[TargetGroup]) -> bool:
    """Write ``groups`` to ``path`` atomically; returns False (and leaves the file alone) if unchanged."""
    text = json.dumps([g.model_dump() for g in groups], indent=2, sort_keys=True) + "\n"
    try:
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            return False
        # Prometheus usually runs as its own user: the file must be readable by it (targets hold no secrets).
        write_atomic(path, text, mode=0o644)
    except OSError as exc:
        raise ConfigError(
            f"cannot write Prometheus targets {path}: {exc.strerror}",
            hint="check that the target directory exists, is writable by this user and has free space",
        ) from None
    return True


def write_replica_targets(path: Path, replicas: Iterable[ReplicaRecord]) -> bool:
    """:func:`replica_target_groups` then :func:`write_file_sd`."""
    return write_file_sd(path, replica_target_groups(replicas))
