"""The state store and the controller lease on a real six-node Redis Cluster on loopback, under faults.

Real parts: a 6-process Redis Cluster of this module's own (one node is SIGKILLed, so not the session's),
``sim`` replicas started by ``llmctl deploy`` on this host, ``llmctl gateway`` and ``llmctl controller run``
as their own processes, all on one ``redis+cluster://`` URL.

- A master SIGKILLed while requests run through the gateway: once the cluster has failed over, the
  gateway serves again and keeps serving, the controller acts again (it restarts a killed replica),
  ``llmctl deploy`` works, and every deployment and replica record written before is still there.
- The controller SIGKILLed while it scales a deployment up, with a standby running: the standby takes
  the lease after the holder's TTL runs out, finishes the scale, and no replica runs twice; a controller
  started again afterwards stays standby and changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixtures.controller import llmctl_env, start_controller, stop_controller
from fixtures.gateway import LoadLoop, add_key, gateway_process
from fixtures.redis import RedisCluster, failed_over, kill_node, master_of, start_cluster
from fixtures.vllm import LlmctlEnv, group_members

from controlplane.spec import ReplicaRecord, ReplicaState
from controlplane.state import open_store

__all__ = ["llmctl_env"]  # the fixture, imported for this module

pytestmark = [pytest.mark.redis, pytest.mark.slow]

_LEASE_TTL_S = 3.0
_PERIOD_S = 1.0
_CONFIG = f"""\
period_s: {_PERIOD_S}
probe_timeout_s: 2
lease_ttl_s: {_LEASE_TTL_S}
healing:
  restart_backoff_s: 0.5
  restart_backoff_max_s: 2
"""
_TAG = "{sarv:}"
"""The store's hash tag: every record and the lease live in its slot, on one master."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A cluster of this test's own: the tests kill its nodes."""
    with start_cluster(tmp_path / "redis-cluster") as c:
        yield c


@pytest.fixture
def env(cluster: RedisCluster, llmctl_env: LlmctlEnv) -> LlmctlEnv:
    """``llmctl`` on the cluster (the cluster fixture comes first, so it outlives the clean-up)."""
    llmctl_env.env["SARV_STATE_URL"] = cluster.url
    return llmctl_env


def until(what: str, check: Callable[[], bool], logs: list[Path], limit: float) -> float:
    """Poll ``check`` (bounded by ``limit`` seconds); returns when it held; fails with the logs' tails."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        with contextlib.suppress(Exception):  # the store may be failing over
            if check():
                return time.monotonic()
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in logs if p.exists())
    pytest.fail(f"{what} did not happen within {limit:.0f}s\n{tails}")


def replicas(env: LlmctlEnv, deployment: str | None = None) -> list[ReplicaRecord]:
    store = open_store(env.env["SARV_STATE_URL"])
    try:
        return store.list_replicas(deployment)
    finally:
        store.close()


def pid_of(rec: ReplicaRecord) -> int | None:
    """The local launcher's process id of a replica (its process group leader)."""
    pid = rec.handle.get("pid", "")
    return int(pid) if pid.isdigit() else None


def test_a_killed_master_fails_over_and_the_controller_gateway_and_state_carry_on(
    env: LlmctlEnv, cluster: RedisCluster, tmp_path: Path
) -> None:
    env.llmctl("deploy", "sarv-tiny", "--name", "web", "--engine", "sim", "--replicas", "2", check=True)
    env.llmctl("deploy", "sarv-tiny", "--name", "docs", "--engine", "sim", check=True)
    store = open_store(cluster.url)
    try:
        key = add_key(store)
        before_deps = {d.name: d.spec.replicas for d in store.list_deployments()}
        before_reps = {r.id: (r.deployment, r.index) for r in store.list_replicas()}
    finally:
        store.close()
    assert before_deps == {"web": 2, "docs": 1}
    assert len(before_reps) == 3

    controller, log = start_controller(env, tmp_path / "controller", _CONFIG)
    logs = [log]
    try:
        with gateway_process(env.home, env={"SARV_STATE_URL": cluster.url}) as (port, _gw):
            load = LoadLoop(f"http://127.0.0.1:{port}", key, "web")
            with load.running():
                until("a first answer", lambda: load.ok_since(0.0), logs, limit=30)
                until("the controller leading", lambda: "holds the lease" in log.read_text(), logs, 30)
                dead = master_of(cluster, _TAG)
                killed_at = time.monotonic()
                kill_node(cluster, dead)
                # Failover takes node timeout (5 s) + election; the bound leaves room on a loaded host.
                ok_at = until("the failover", lambda: failed_over(cluster, _TAG, dead), logs, limit=45)
                until("the gateway serving again", lambda: load.ok_since(ok_at), logs, limit=30)
                # The controller acts again: a replica killed now is restarted.
                (victim,) = replicas(env, "docs")
                victim_pid = pid_of(victim)
                assert victim_pid
                os.killpg(victim_pid, signal.SIGKILL)
                until(
                    "the killed replica restarted",
                    lambda: any(
                        r.state is ReplicaState.READY and pid_of(r) not in (None, victim_pid)
                        for r in replicas(env, "docs")
                    ),
                    logs,
                    limit=60,
                )
                deployed = env.llmctl("deploy", "sarv-tiny", "--name", "late", "--engine", "sim")
                assert deployed.returncode == 0, deployed.stderr
                served_since = time.monotonic()
                until("more answers", lambda: load.ok_since(served_since), logs, limit=30)
    finally:
        stop_controller(controller)

    # What the gateway answered: every request that started once the gateway served again after the
    # failover got 200; the others that did not are the ones around the fault only.
    recovered = min(s for s, _, o in load.results if s >= ok_at and o == "200")
    after = [o for s, _, o in load.results if s >= recovered]
    assert after and set(after) == {"200"}, after
    failed = [(round(s - killed_at, 2), o) for s, _, o in load.results if o != "200"]
    assert all(s < recovered - killed_at for s, _ in failed), failed
    # While the key store fails over, the gateway refuses (fail closed) once its key cache runs out.
    assert {o for _, o in failed} <= {"503"}, failed
    print(
        f"failover {ok_at - killed_at:.1f}s after the SIGKILL, served again "
        f"{recovered - killed_at:.1f}s after; {len(load.results)} requests, not 200: {failed}"
    )

    store = open_store(cluster.url)
    try:
        after_deps = {d.name: d.spec.replicas for d in store.list_deployments()}
        after_reps = {r.id: (r.deployment, r.index) for r in store.list_replicas()}
        events = [e.reason for e in store.list_events()]
    finally:
        store.close()
    assert after_deps == {**before_deps, "late": 1}
    assert set(before_reps.items()) <= set(after_reps.items())
    assert "Restarted" in events


def live_replica_groups(env: LlmctlEnv, deployment: str) -> list[int]:
    """Process groups on this host started for ``deployment`` (by their log file in the llmctl home),
    whether a record names them or not."""
    marker = f"--served-model-name {deployment} "
    groups: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if str(env.home) in cmdline and marker in cmdline + " ":
                groups.add(os.getpgid(int(entry.name)))
    return sorted(g for g in groups if group_members(g))


def test_a_controller_killed_mid_scale_is_taken_over_by_the_standby_without_duplicates(
    env: LlmctlEnv, cluster: RedisCluster, tmp_path: Path
) -> None:
    env.llmctl("deploy", "sarv-tiny", "--name", "web", "--engine", "sim", check=True)
    scale_up = _CONFIG + "deployments:\n  web: {min_replicas: 3, max_replicas: 3}\n"
    first, first_log = start_controller(env, tmp_path / "a", scale_up)
    logs = [first_log]
    started: list[subprocess.Popen[bytes]] = [first]
    try:
        until("a leader", lambda: "holds the lease" in first_log.read_text(), logs, limit=30)
        standby, standby_log = start_controller(env, tmp_path / "b", scale_up)
        started.append(standby)
        logs.append(standby_log)
        # SIGKILL the leader as soon as the scale has written a new replica record, before they are ready.
        until("the scale under way", lambda: len(replicas(env, "web")) > 1, logs, limit=30)
        first.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        first.wait(timeout=10)
        at_kill = sorted((r.index, r.state.value) for r in replicas(env, "web"))
        # The standby waits for the dead holder's lease to expire (TTL), then takes it on its next pass.
        took = until(
            "the standby leading",
            lambda: "holds the lease" in standby_log.read_text(),
            logs,
            limit=_LEASE_TTL_S + 3 * _PERIOD_S + 10,
        )
        takeover_s = took - killed_at
        until(
            "three ready replicas",
            lambda: (
                sorted((r.index, r.state) for r in replicas(env, "web"))
                == [(i, ReplicaState.READY) for i in range(3)]
            ),
            logs,
            limit=90,
        )
        # Started again, the killed controller is a standby now: it does nothing while the other leads.
        again, again_log = start_controller(env, tmp_path / "c", scale_up)
        started.append(again)
        logs.append(again_log)
        until("the restarted controller running", lambda: "every" in again_log.read_text(), logs, 30)
        time.sleep(3 * _PERIOD_S)
        assert "holds the lease" not in again_log.read_text()
    finally:
        for proc in started:
            if proc.poll() is None:
                stop_controller(proc)

    final = replicas(env, "web")
    assert sorted(r.index for r in final) == [0, 1, 2], at_kill
    assert len({r.id for r in final}) == 3
    recorded = sorted(p for p in map(pid_of, final) if p)
    assert len(recorded) == 3
    assert live_replica_groups(env, "web") == recorded, f"at the kill: {at_kill}"
    print(f"at the kill: {at_kill}; standby took over {takeover_s:.1f}s after it (lease TTL {_LEASE_TTL_S}s)")
