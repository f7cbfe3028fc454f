"""Healing end to end: real ``sim`` replicas started by ``llmctl deploy``, the real controller process.

A replica whose process group is killed is started again after the back-off; a replica whose engine
exits at start is a crash loop: reported (state, event) and no longer restarted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.controller import controller_process, llmctl_env
from fixtures.vllm import LlmctlEnv

from controlplane.state import open_store
from controlplane.state.base import EventRecord

__all__ = ["llmctl_env"]  # the fixture, imported for this module

_CONFIG = """\
period_s: 0.3
probe_timeout_s: 2
healing:
  restart_backoff_s: 0.5
  restart_backoff_max_s: 2
  crash_loop_restarts: 3
  crash_loop_window_s: 120
"""


def controller(env: LlmctlEnv, tmp_path: Path) -> contextlib.AbstractContextManager[Path]:
    return controller_process(env, tmp_path, _CONFIG)


def events(env: LlmctlEnv) -> list[EventRecord]:
    store = open_store(env.env["SARV_STATE_URL"])
    try:
        return store.list_events()
    finally:
        store.close()


def replica(env: LlmctlEnv) -> dict[str, Any]:
    (dep,) = env.status()["deployments"]
    (rep,) = dep["replicas"]
    return rep  # type: ignore[no-any-return]


def until(what: str, check: Callable[[], bool], tmp_path: Path, limit: float = 60.0) -> None:
    """Poll ``check`` (bounded); on running out, fail with the controller's log."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    log = (tmp_path / "controller.log").read_text()[-3000:]
    pytest.fail(f"{what} did not happen within {limit:.0f}s; controller log:\n{log}")


def test_a_killed_replica_is_restarted_after_the_back_off(llmctl_env: LlmctlEnv, tmp_path: Path) -> None:
    env = llmctl_env
    env.llmctl("deploy", "sarv-tiny", "--engine", "sim", check=True)
    before = replica(env)
    assert before["state"] == "ready"
    with controller(env, tmp_path):
        os.killpg(before["pid"], signal.SIGKILL)  # the supervisor and the engine: the process is gone
        until("a restart", lambda: any(e.reason == "Restarted" for e in events(env)), tmp_path)
        until("the new replica ready", lambda: replica(env)["state"] == "ready", tmp_path)
    after = replica(env)
    assert after["pid"] != before["pid"]
    (restarted,) = [e for e in events(env) if e.reason == "Restarted"]
    assert restarted.object == "replica/sarv-tiny-0"
    assert restarted.deployment == "sarv-tiny"
    assert restarted.source == "controller"
    assert "crashed" in restarted.message
    assert "crash 1 in" in restarted.message


def test_a_crash_loop_is_reported_and_no_longer_restarted(llmctl_env: LlmctlEnv, tmp_path: Path) -> None:
    env = llmctl_env
    # The engine exits at once every time: `deploy --no-wait` leaves it to the launcher and controller.
    env.llmctl(
        "deploy", "sarv-tiny", "--engine", "sim", "--engine-arg", "exit_at_start=3", "--no-wait", check=True
    )
    with controller(env, tmp_path):
        until("a crash loop", lambda: any(e.reason == "CrashLoop" for e in events(env)), tmp_path, limit=90)
        looping = replica(env)
        assert looping["state"] == "failed"
        assert looping["message"].startswith("crash loop: 3 crashes in 120 s, last exit code 3")
        seen = len(events(env))
        time.sleep(2.0)  # several passes: nothing more is done for it
        assert replica(env)["state"] == "failed"
        assert len(events(env)) == seen
    (loop,) = [e for e in events(env) if e.reason == "CrashLoop"]
    assert loop.type == "Warning"
    assert "not restarted" in loop.message
    assert "llmctl logs sarv-tiny-0" in loop.message
