"""The health rule: one probe result turns a replica's observed state into its next one.

Pure (previous state, probe, streak → verdict), so the reconcile loop and ``llmctl status`` reach the
same verdict from the same facts; only the streak differs (the loop keeps it across passes, ``status``
starts from none).
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.spec import ReplicaRecord, ReplicaState

__all__ = ["PROBED_STATES", "HealthRule", "Streak", "Verdict", "judge", "probe_path"]

PROBED_STATES = frozenset({ReplicaState.STARTING, ReplicaState.READY, ReplicaState.UNHEALTHY})
"""States whose replica has an engine to probe; the rule leaves every other state as it is."""


@dataclass(frozen=True)
class HealthRule:
    """The thresholds (``ControllerConfig.failure_threshold``/``success_threshold``)."""

    failure_threshold: int = 3
    """Consecutive failed health checks before a ready replica is unhealthy."""
    success_threshold: int = 1
    """Consecutive passed health checks before an unhealthy replica is ready again."""


@dataclass(frozen=True)
class Streak:
    """Consecutive probe results of one replica, as far as the caller has seen them."""

    failures: int = 0
    successes: int = 0


@dataclass(frozen=True)
class Verdict:
    state: ReplicaState
    message: str
    streak: Streak


def probe_path(rec: ReplicaRecord) -> str:
    """What to probe: the ready path while the engine loads (its health path can answer earlier)."""
    return rec.probes.ready if rec.state is ReplicaState.STARTING else rec.probes.health


def judge(
    rule: HealthRule,
    state: ReplicaState,
    message: str,
    *,
    ok: bool,
    error: str = "",
    streak: Streak = Streak(),
) -> Verdict:
    """The state after one probe of a replica in ``state`` (``ok`` for HTTP 200 from :func:`probe_path`).

    ``starting`` → ``ready`` on the first success (failures while loading are the deployer's timeout to
    judge, not health); ``ready`` → ``unhealthy`` after ``failure_threshold`` failures in a row;
    ``unhealthy`` → ``ready`` after ``success_threshold`` successes in a row.
    """
    if state not in PROBED_STATES:
        return Verdict(state, message, streak)
    if ok:
        after = Streak(successes=streak.successes + 1)
        recovered = state is ReplicaState.UNHEALTHY and after.successes >= rule.success_threshold
        if state is ReplicaState.STARTING or recovered:
            return Verdict(ReplicaState.READY, "", after)
        return Verdict(state, message, after)
    if state is ReplicaState.STARTING:
        return Verdict(state, message, Streak())
    after = Streak(failures=streak.failures + 1)
    if state is ReplicaState.READY and after.failures >= rule.failure_threshold:
        message = f"health check failed {after.failures} times in a row: {error}"
        return Verdict(ReplicaState.UNHEALTHY, message, after)
    return Verdict(state, message, after)
