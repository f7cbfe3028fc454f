"""This host's launcher: replicas as detached local processes, with their logs kept under Sarv's home."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from controlplane.engines.base import EngineLaunch
from controlplane.errors import LaunchError
from controlplane.launchers.base import ProcessState, ReplicaProcess
from controlplane.weights import WeightsPolicy, ensure_weights

__all__ = ["LocalLauncher", "process_identity"]

_POLL_S = 0.1


def process_identity(pid: int) -> tuple[str, int, str] | None:
    """``(state, process group, start time)`` of ``pid`` from ``/proc``, or None when there is none.

    The start time (clock ticks since boot) tells a live replica from an unrelated process that was
    given the same pid later: a handle is acted on only when both match.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[2]), fields[19]


def _group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in process group ``pgid`` (the replica and its workers)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        ident = process_identity(int(entry.name))
        if ident is not None and ident[1] == pgid and ident[0] != "Z":
            return True
    return False


def _groups_in(run: Path) -> set[int]:
    """Process groups with a process working in ``run`` (a replica's run directory: every process a
    start leaves there keeps it, see :meth:`LocalLauncher.start`)."""
    where = os.path.realpath(run)
    groups: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:  # gone meanwhile, or another user's
            continue
        ident = process_identity(int(entry.name))
        if cwd == where and ident is not None and ident[0] != "Z":
            groups.add(ident[1])
    return groups


def _supervisor_status(handle: dict[str, str]) -> tuple[int, int | None]:
    """``(restarts, last exit code)`` from the supervisor's status file; ``(0, None)`` when unsupervised."""
    path = handle.get("status")
    if not path:
        return 0, None
    try:
        data = json.loads(Path(path).read_text())
        code = data.get("last_exit_code")
        return int(data.get("restarts", 0)), int(code) if code is not None else None
    except (OSError, ValueError, TypeError, AttributeError):
        return 0, None


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class LocalLauncher:
    """Starts engine commands as session leaders on this host, so they outlive ``llmctl``.

    Each replica gets a run directory ``<home>/replicas/<id>/`` with its log (appended across restarts,
    so a crash's output survives the next start). Everything a replica spawns stays in its process
    group, and ``stop`` signals the whole group.
    """

    name = "local"

    def __init__(self, home: Path, model_cache: Path, *, host: str = "127.0.0.1", restarts: int = 3) -> None:
        self.home = home
        self.model_cache = model_cache
        self.host = host
        self.restarts = restarts
        """Restarts after a crash (by ``controlplane.launchers.supervisor``); 0 runs the engine bare."""
        # Children started by this object, so their exit codes can be collected (and zombies reaped).
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._started: dict[int, str] = {}
        self._exit_codes: dict[tuple[int, str], int] = {}

    def run_dir(self, replica_id: str) -> Path:
        return self.home / "replicas" / replica_id

    def allocate_port(self, preferred: int | None = None) -> int:
        if preferred is not None:
            if port_in_use(self.host, preferred):
                raise LaunchError(
                    f"port {preferred} on {self.host} is already in use",
                    hint="choose another --port, or stop what listens there",
                )
            return preferred
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((self.host, 0))
            return int(s.getsockname()[1])

    def ensure_weights(
        self,
        source: str,
        model: str,
        *,
        policy: WeightsPolicy,
        progress: Callable[[str], None] | None = None,
    ) -> Path:
        return ensure_weights(source, model, self.model_cache, policy=policy, progress=progress)

    def start(self, replica_id: str, launch: EngineLaunch) -> dict[str, str]:
        if shutil.which(launch.argv[0]) is None:
            raise LaunchError(
                f"cannot start {replica_id}: {launch.argv[0]} is not an executable on this host"
            )
        run = self.run_dir(replica_id)
        run.mkdir(parents=True, exist_ok=True, mode=0o700)
        log = run / "replica.log"
        # Sarv's own settings (state URL, Redis password …) are none of the engine's business.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SARV_")}
        env.update(launch.env)
        env.update({k: v.get_secret_value() for k, v in launch.secret_env.items()})
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as out:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            # argv never holds secrets (they travel in secret_env), so it is safe to log.
            out.write(f"=== sarv: {stamp} starting {replica_id}: {shlex.join(launch.argv)!r}\n".encode())
            out.flush()
            argv = launch.argv
            status = run / "supervisor.json"
            if self.restarts > 0:
                status.unlink(missing_ok=True)
                argv = [
                    sys.executable,
                    "-m",
                    "controlplane.launchers.supervisor",
                    "--restarts",
                    str(self.restarts),
                    "--status",
                    str(status),
                    "--",
                    *launch.argv,
                ]
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=run,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as exc:
                raise LaunchError(f"cannot start {replica_id}: {launch.argv[0]}: {exc.strerror}") from None
        ident = process_identity(proc.pid)
        self._children[proc.pid] = proc
        self._started[proc.pid] = ident[2] if ident else ""
        return {
            "launcher": self.name,
            "host": socket.gethostname(),
            "pid": str(proc.pid),
            "start_time": ident[2] if ident else "",
            "log": str(log),
            **({"status": str(status)} if self.restarts > 0 else {}),
        }

    def _identity(self, handle: dict[str, str]) -> tuple[int, str]:
        """``(pid, how)``: how is ``ours`` (pid and start time match), ``reused`` (the pid now names
        another process) or ``absent`` (no process has that pid)."""
        pid = int(handle.get("pid", "0") or 0)
        if pid <= 1:
            return pid, "reused"
        ident = process_identity(pid)
        if ident is None:
            return pid, "absent"
        return pid, "ours" if ident[2] == handle.get("start_time") else "reused"

    def poll(self, handle: dict[str, str]) -> ReplicaProcess:
        pid, how = self._identity(handle)
        key = (pid, handle.get("start_time", ""))
        if how == "ours":
            self._reap(pid)
        if key in self._exit_codes:
            return ReplicaProcess(state=ProcessState.EXITED, exit_code=self._exit_codes[key])
        if how == "reused":
            return ReplicaProcess(state=ProcessState.GONE)
        if how == "absent":
            # Linux does not hand out a pid while a process group of that id exists, so a live group
            # here is ours: the leader died but its workers run on. Report it so the caller stops them.
            if _group_alive(pid):
                return ReplicaProcess(state=ProcessState.EXITED, detail="leader exited, workers remain")
            return ReplicaProcess(state=ProcessState.GONE)
        ident = process_identity(pid)
        if ident is not None and ident[0] == "Z":
            return ReplicaProcess(state=ProcessState.EXITED)
        restarts, last = _supervisor_status(handle)
        return ReplicaProcess(state=ProcessState.RUNNING, restarts=restarts, exit_code=last)

    def claim(self, replica_id: str) -> dict[str, str]:
        """The replica's run directory, where every process a start leaves works (see
        :func:`~controlplane.launchers.claim_handle`)."""
        return {"launcher": self.name, "host": socket.gethostname(), "run_dir": str(self.run_dir(replica_id))}

    def stop(self, handle: dict[str, str], *, timeout: float = 30.0) -> None:
        if not handle.get("pid") and handle.get("run_dir"):
            # A claim: whatever a start whose handle was lost left running.
            for group in sorted(_groups_in(Path(handle["run_dir"]))):
                ident = process_identity(group)
                self.stop({"pid": str(group), "start_time": ident[2] if ident else ""}, timeout=timeout)
            return
        pid, how = self._identity(handle)
        if how == "reused":
            return
        if how == "absent" and not _group_alive(pid):
            self._exit_codes.pop((pid, handle.get("start_time", "")), None)
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self._reap(pid)
                if not _group_alive(pid):
                    # Stopped on purpose: reap the (zombie) leader and forget its exit code.
                    if pid in self._children:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            self._children[pid].wait(timeout=5)
                        self._reap(pid)
                    self._exit_codes.pop((pid, handle.get("start_time", "")), None)
                    return
                time.sleep(_POLL_S)
        raise LaunchError(f"process group {pid} did not exit after SIGKILL", hint=f"check `ps -g {pid}`")

    def _reap(self, pid: int) -> None:
        """Collect the exit code of a child this object started (so it does not linger as a zombie)."""
        child = self._children.get(pid)
        if child is not None and child.poll() is not None:
            self._children.pop(pid, None)
            ident = self._started.pop(pid, "")
            self._exit_codes[(pid, ident)] = child.returncode

    def logs(self, handle: dict[str, str], *, follow: bool = False, tail: int = 200) -> Iterator[str]:
        path = Path(handle.get("log", ""))
        if not path.is_file():
            return
        with path.open("rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
            yield from lines[-tail:] if tail > 0 else lines
            if not follow:
                return
            buf = b""
            # Follow until the replica is gone (or the reader interrupts), like `tail -f --pid`.
            while True:
                chunk = f.read()
                if chunk:
                    buf += chunk
                    *done, buf = buf.split(b"\n")
                    for line in done:
                        yield line.decode(errors="replace")
                    continue
                if self.poll(handle).state is not ProcessState.RUNNING:
                    if buf:
                        yield buf.decode(errors="replace")
                    return
                time.sleep(0.25)
