"""The healing rules in simulated time: restart back-off, crash loops, the node grace period."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from controlplane.controller.healing import (
    CrashRecord,
    HealingConfig,
    NodeWatch,
    crash_seen,
    node_seen,
    restart_due,
)

CFG = HealingConfig(
    restart_backoff_s=2,
    restart_backoff_max_s=10,
    crash_loop_restarts=5,
    crash_loop_window_s=100,
    node_grace_s=30,
)


def test_back_off_doubles_up_to_its_maximum() -> None:
    record, now, waits = CrashRecord(), 0.0, []
    for _ in range(4):
        record = crash_seen(CFG, record, now)
        assert record.restart_at is not None
        waits.append(record.restart_at - now)
        now = record.restart_at
    assert waits == [2, 4, 8, 10]


def test_restart_is_due_only_after_the_back_off() -> None:
    record = crash_seen(CFG, CrashRecord(), 50.0)
    assert not restart_due(record, 51.9)
    assert restart_due(record, 52.0)


def test_n_crashes_within_the_window_are_a_crash_loop_and_no_restart_is_owed() -> None:
    record = CrashRecord()
    for t in (0.0, 10.0, 20.0, 30.0):
        record = crash_seen(CFG, record, t)
        assert not record.crash_loop
    record = crash_seen(CFG, record, 40.0)
    assert record.crash_loop
    assert record.restart_at is None
    assert not restart_due(record, 1e9)


def test_crashes_older_than_the_window_are_forgotten_and_the_back_off_starts_over() -> None:
    record = CrashRecord()
    for t in (0.0, 10.0, 20.0, 30.0):
        record = crash_seen(CFG, record, t)
    record = crash_seen(CFG, record, 500.0)
    assert (record.count, record.crash_loop) == (1, False)
    assert record.restart_at == 502.0


def test_several_crashes_seen_at_once_count_each() -> None:
    # A launcher's own supervisor restarted the engine 5 times between two looks.
    assert crash_seen(CFG, CrashRecord(), 0.0, crashes=5).crash_loop


def test_node_is_lost_only_after_the_grace_period_of_silence() -> None:
    watch = NodeWatch()
    for t in (0.0, 10.0, 29.0):
        watch = node_seen(CFG, watch, t, answered=False)
        assert not watch.lost
    assert watch.silent_since == 0.0
    watch = node_seen(CFG, watch, 30.0, answered=False)
    assert watch.lost


def test_one_answer_resets_the_silence_and_a_lost_node_is_a_candidate_again() -> None:
    watch = node_seen(CFG, NodeWatch(), 0.0, answered=False)
    watch = node_seen(CFG, watch, 20.0, answered=True)
    assert watch == NodeWatch()
    lost = node_seen(CFG, node_seen(CFG, NodeWatch(), 0.0, answered=False), 60.0, answered=False)
    assert lost.lost
    assert node_seen(CFG, lost, 61.0, answered=True) == NodeWatch()


def test_base_above_max_is_refused() -> None:
    with pytest.raises(ValidationError, match="exceeds restart_backoff_max_s"):
        HealingConfig(restart_backoff_s=30, restart_backoff_max_s=10)
