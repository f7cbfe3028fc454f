"""Healing rules: when a crashed replica is restarted, when it is a crash loop, when a node is lost.

Pure (config, what was seen so far, now → what to do), so the rules are tested in simulated time; the
reconcile loop keeps the state per replica and per node and acts on the answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["CrashRecord", "HealingConfig", "NodeWatch", "crash_seen", "node_seen", "restart_due"]


class HealingConfig(BaseModel):
    """The ``healing`` section of the controller's YAML file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    restart_backoff_s: float = Field(default=2.0, gt=0, le=3600)
    """Wait before the first restart of a crashed replica; doubled for each further crash."""
    restart_backoff_max_s: float = Field(default=120.0, gt=0, le=86_400)
    """Longest wait between two restarts."""
    crash_loop_restarts: int = Field(default=5, ge=1, le=1000)
    """Crashes within ``crash_loop_window_s`` that make a crash loop: reported, and no more restarts."""
    crash_loop_window_s: float = Field(default=600.0, gt=0, le=86_400)
    node_grace_s: float = Field(default=60.0, gt=0, le=86_400)
    """How long every replica of a node must fail its probes before the node counts as lost and its
    replicas are placed elsewhere."""

    @model_validator(mode="after")
    def _order(self) -> HealingConfig:
        if self.restart_backoff_s > self.restart_backoff_max_s:
            raise ValueError(
                f"restart_backoff_s ({self.restart_backoff_s}) exceeds "
                f"restart_backoff_max_s ({self.restart_backoff_max_s})"
            )
        return self


@dataclass(frozen=True)
class CrashRecord:
    """The crashes of one replica that still count (within the window), and when it may start again."""

    crashes: tuple[float, ...] = ()
    restart_at: float | None = None
    """None: no restart is owed (running, or given up)."""
    crash_loop: bool = False
    """Given up: ``crash_loop_restarts`` crashes within the window."""

    @property
    def count(self) -> int:
        return len(self.crashes)


def crash_seen(cfg: HealingConfig, record: CrashRecord, now: float, crashes: int = 1) -> CrashRecord:
    """``record`` after ``crashes`` more crashes seen at ``now``: the next restart waits
    ``min(max, base × 2^(n-1))`` for the n-th crash in the window; at ``crash_loop_restarts`` crashes
    in the window it is a crash loop and no restart is owed."""
    kept = tuple(t for t in record.crashes if now - t < cfg.crash_loop_window_s)
    crashed = (*kept, *([now] * crashes))
    if len(crashed) >= cfg.crash_loop_restarts:
        return CrashRecord(crashed, None, crash_loop=True)
    delay = min(cfg.restart_backoff_max_s, cfg.restart_backoff_s * 2 ** (len(crashed) - 1))
    return CrashRecord(crashed, now + delay)


def restart_due(record: CrashRecord, now: float) -> bool:
    return not record.crash_loop and record.restart_at is not None and now >= record.restart_at


@dataclass(frozen=True)
class NodeWatch:
    """Whether a node answers, as far as its replicas' probes tell."""

    silent_since: float | None = None
    """Since when no replica of the node has answered a probe (None: one answered last pass)."""
    lost: bool = False
    """Silent for longer than ``node_grace_s``: its replicas were (or are to be) placed elsewhere."""


def node_seen(cfg: HealingConfig, watch: NodeWatch, now: float, *, answered: bool) -> NodeWatch:
    """``watch`` after a pass in which some replica of the node ``answered`` a probe, or none did.

    A node that answers is a candidate again at once (``lost`` False)."""
    if answered:
        return NodeWatch()
    since = watch.silent_since if watch.silent_since is not None else now
    return NodeWatch(since, lost=watch.lost or now - since >= cfg.node_grace_s)
