"""The local launcher runs real detached processes, keeps their logs and never kills a stale pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.common import free_port

from controlplane.engines.base import EngineLaunch
from controlplane.errors import LaunchError
from controlplane.launchers import LocalLauncher, ProcessState
from controlplane.launchers.local import process_identity

# A replica stand-in that starts a child of its own (as vLLM starts its engine core) and prints.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print("child", child.pid, flush=True)
time.sleep(300)
"""


def _wait(cond: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError("condition not met")


def _alive(pid: int) -> bool:
    ident = process_identity(pid)
    return ident is not None and ident[0] != "Z"


@pytest.fixture(params=[0, 3], ids=["bare", "supervised"])
def launcher(tmp_path: Path, request: pytest.FixtureRequest) -> LocalLauncher:
    return LocalLauncher(tmp_path / "home", tmp_path / "models", restarts=request.param)


def test_start_poll_logs_stop_kills_the_whole_group(launcher: LocalLauncher) -> None:
    launch = EngineLaunch(argv=[sys.executable, "-c", _PARENT], env={"X_SARV": "1"}, port=free_port())
    handle = launcher.start("r-0", launch)
    try:
        assert launcher.poll(handle).state is ProcessState.RUNNING
        _wait(lambda: any(line.startswith("child ") for line in launcher.logs(handle)))
        child = int(next(ln for ln in launcher.logs(handle) if ln.startswith("child ")).split()[1])
        lines = list(launcher.logs(handle))
        assert lines[0].startswith("=== sarv: ") and "starting r-0" in lines[0]
        # A new session: the replica does not die with the terminal (or the llmctl) that started it.
        assert os.getsid(int(handle["pid"])) == int(handle["pid"])
    finally:
        launcher.stop(handle, timeout=10)
    assert launcher.poll(handle).state is ProcessState.GONE
    assert not _alive(child)
    assert oct(Path(handle["log"]).stat().st_mode & 0o777) == "0o600"


def test_secret_env_reaches_the_process_but_not_the_log(
    launcher: LocalLauncher, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydantic import SecretStr

    monkeypatch.setenv("SARV_REDIS_PASSWORD", "not-for-engines")
    code = (
        "import os; "
        "print('key-len', len(os.environ['VLLM_API_KEY']), 'SARV_REDIS_PASSWORD' in os.environ, flush=True)"
    )
    launch = EngineLaunch(
        argv=[sys.executable, "-c", code], secret_env={"VLLM_API_KEY": SecretStr("s3cr3t")}, port=1
    )
    handle = launcher.start("r-1", launch)
    _wait(lambda: launcher.poll(handle).state is not ProcessState.RUNNING)
    text = "\n".join(launcher.logs(handle))
    assert "key-len 6 False" in text
    assert "s3cr3t" not in text
    launcher.stop(handle)


def test_exit_code_of_a_crashing_process(tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path / "home", tmp_path / "models", restarts=0)
    launch = EngineLaunch(argv=[sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], port=1)
    handle = launcher.start("r-2", launch)
    _wait(lambda: launcher.poll(handle).state is not ProcessState.RUNNING)
    proc = launcher.poll(handle)
    assert proc.state is ProcessState.EXITED
    assert proc.exit_code == 3
    launcher.stop(handle)


def test_a_stale_handle_never_kills_the_process_now_holding_the_pid(launcher: LocalLauncher) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        ident = process_identity(other.pid)
        assert ident is not None
        # Same pid, different start time: what a pid reused after a reboot or wrap-around looks like.
        stale = {"launcher": "local", "pid": str(other.pid), "start_time": str(int(ident[2]) - 1), "log": ""}
        assert launcher.poll(stale).state is ProcessState.GONE
        launcher.stop(stale, timeout=1)
        assert other.poll() is None
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait(timeout=10)


def test_a_handle_from_another_launcher_instance_can_stop_the_replica(tmp_path: Path) -> None:
    first = LocalLauncher(tmp_path / "home", tmp_path / "models")
    handle = first.start("r-3", EngineLaunch(argv=[sys.executable, "-c", _PARENT], port=1))
    # What a later `llmctl undeploy` sees: only the stored handle, not the Popen object.
    second = LocalLauncher(tmp_path / "home", tmp_path / "models")
    assert second.poll(handle).state is ProcessState.RUNNING
    second.stop(handle, timeout=10)
    _wait(lambda: first.poll(handle).state is not ProcessState.RUNNING)
    first.stop(handle)
    assert first.poll(handle).state is ProcessState.GONE


def test_preferred_port_in_use_is_refused(launcher: LocalLauncher) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port} on 127.0.0.1 is already in use"):
            launcher.allocate_port(port)
    assert launcher.allocate_port(None) > 0


def test_missing_executable_is_a_launch_error(launcher: LocalLauncher) -> None:
    # Checked before anything starts, with or without a supervisor in between.
    with pytest.raises(LaunchError, match="cannot start r-4"):
        launcher.start("r-4", EngineLaunch(argv=["/nonexistent/engine"], port=1))


def test_env_file_is_0600_and_holds_the_secret(tmp_path: Path) -> None:
    from pydantic import SecretStr

    from controlplane.launchers.base import write_env_file

    path = tmp_path / "run" / "r.env"
    path.parent.mkdir()
    path.write_text("old")
    path.chmod(0o644)
    write_env_file(path, {"VLLM_API_KEY": SecretStr("sk-1")})
    assert path.read_text() == "VLLM_API_KEY=sk-1\n"
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(LaunchError, match="newline"):
        write_env_file(path, {"K": SecretStr("a\nB=c")})


_CRASH_ONCE = """
import pathlib, sys, time
marker = pathlib.Path("crashed-once")
if not marker.exists():
    marker.write_text("x")
    print("crashing", flush=True)
    sys.exit(5)
print("second life", flush=True)
time.sleep(300)
"""


def test_supervisor_restarts_a_crashed_engine_and_reports_it(tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path / "home", tmp_path / "models", restarts=3)
    handle = launcher.start("r-5", EngineLaunch(argv=[sys.executable, "-c", _CRASH_ONCE], port=1))
    try:
        _wait(lambda: "second life" in list(launcher.logs(handle)))
        proc = launcher.poll(handle)
        assert proc.state is ProcessState.RUNNING
        assert (proc.restarts, proc.exit_code) == (1, 5)
        assert "engine exited with code 5; restart 1/3" in "\n".join(launcher.logs(handle))
    finally:
        launcher.stop(handle, timeout=10)
    assert launcher.poll(handle).state is ProcessState.GONE


def test_supervisor_gives_up_after_its_restarts(tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path / "home", tmp_path / "models", restarts=1)
    launch = EngineLaunch(argv=[sys.executable, "-c", "import sys; sys.exit(4)"], port=1)
    handle = launcher.start("r-6", launch)
    _wait(lambda: launcher.poll(handle).state is not ProcessState.RUNNING)
    proc = launcher.poll(handle)
    assert (proc.state, proc.exit_code) == (ProcessState.EXITED, 4)
    launcher.stop(handle)


def test_the_telling_line_of_a_journal_is_the_processs_error_not_systemds_verdict() -> None:
    """A unit's journal (``journalctl -u … -o cat``) ends with systemd's own lines, which say only that it
    failed: the line taken is the process's error, or systemd's reason when the process said nothing."""
    from controlplane.launchers.base import last_error_line

    crashed = [
        "Started sarv-web-0.service - Sarv replica web-0.",
        "INFO loading weights",
        "ValueError: max_model_len 8192 is larger than the model's 2048",
        "sarv-web-0.service: Main process exited, code=exited, status=1/FAILURE",
        "sarv-web-0.service: Failed with result 'exit-code'.",
        "sarv-web-0.service: Scheduled restart job, restart counter is at 1.",
        "Stopped sarv-web-0.service - Sarv replica web-0.",
    ]
    assert last_error_line(crashed) == "ValueError: max_model_len 8192 is larger than the model's 2048"
    # Type=exec: the start itself failed, and systemd's own line says why.
    not_spawned = [
        "sarv-web-0.service: Failed to locate executable /opt/venv/bin/python: No such file or directory",
        "sarv-web-0.service: Failed at step EXEC spawning /opt/venv/bin/python: No such file or directory",
        "sarv-web-0.service: Main process exited, code=exited, status=203/EXEC",
        "sarv-web-0.service: Failed with result 'exit-code'.",
        "Failed to start sarv-web-0.service - Sarv replica web-0.",
    ]
    assert last_error_line(not_spawned).startswith("sarv-web-0.service: Failed at step EXEC spawning")
    # Killed without a word: systemd's verdict is all there is.
    killed = ["INFO loading weights", "sarv-web-0.service: Failed with result 'oom-kill'."]
    assert last_error_line(killed) == "sarv-web-0.service: Failed with result 'oom-kill'."
    assert last_error_line(["INFO loading weights", "  "]) == "INFO loading weights"
    assert last_error_line(["-- No entries --"]) == ""
