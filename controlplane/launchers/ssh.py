"""Remote nodes over SSH (Fabric): one hardened systemd unit per replica, followed through systemd."""

from __future__ import annotations

import io
import re
import shlex
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from controlplane.engines.base import EngineLaunch
from controlplane.errors import DiscoveryError, LaunchError
from controlplane.launchers.base import ProcessState, ReplicaProcess, env_file_text, last_error_line
from controlplane.launchers.units import UNIT_DIR, UnitSpec, env_file_path, render_unit, unit_name
from controlplane.spec import Node
from controlplane.weights import MANIFEST_NAME, WeightsPolicy, ensure_weights, sha256_file
from controlplane.weights.distribute import Peer, verify_command

if TYPE_CHECKING:
    from fabric import Connection

    from controlplane.remote import FabricConnector

__all__ = ["POLL_TIMEOUT_S", "RemoteResult", "SshLauncher", "UnitState"]

_INET_RE = re.compile(r"\binet (\d{1,3}(?:\.\d{1,3}){3})/")
# systemd states in which the main process is (still) meant to run.
POLL_TIMEOUT_S = 10.0
"""Limit of one poll of a replica's unit (a ``systemctl show``, well under a second on a live node). A
node cut off without a TCP reset never answers: the poll fails after this long, so the controller's pass
goes on and counts the node silent, instead of holding every deployment for the command timeout."""

_RUNNING = {"active", "activating", "reloading", "deactivating"}


@dataclass(frozen=True)
class RemoteResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def said(self) -> str:
        """The first non-empty line of the output, for one-line errors."""
        lines = [ln.strip() for ln in (self.stderr + "\n" + self.stdout).splitlines() if ln.strip()]
        return lines[0][:300] if lines else f"exit code {self.exit_code}"


@dataclass(frozen=True)
class UnitState:
    """``systemctl show`` of one unit, reduced to what a launcher decides on."""

    load: str
    active: str
    sub: str
    exit_status: int | None
    restarts: int = 0

    @property
    def process(self) -> ReplicaProcess:
        if self.load == "not-found":
            return ReplicaProcess(state=ProcessState.GONE)
        # "auto-restart" is systemd waiting to restart a crashed process: for a start-up or a health
        # check that is a failure to report, not a replica that runs.
        if self.active in _RUNNING and self.sub != "auto-restart":
            return ReplicaProcess(
                state=ProcessState.RUNNING, restarts=self.restarts, exit_code=self.exit_status
            )
        return ReplicaProcess(
            restarts=self.restarts,
            state=ProcessState.EXITED,
            exit_code=self.exit_status,
            detail=f"{self.active}/{self.sub}",
        )


class SshLauncher:
    """Runs replicas on one remote node as systemd units, over one Fabric connection.

    The SSH user is root or has passwordless sudo (the provisioning roles set that up). Engines bind
    to the node's private address: the IPv4 address of ``node.nic`` when the inventory names one,
    else ``node.address``; never 0.0.0.0. Secrets travel in a root-owned 0600 ``EnvironmentFile``,
    written over SFTP, so they are in neither the unit, argv nor a remote process list.
    """

    name = "ssh"

    def __init__(
        self,
        node: Node,
        conn: Connection,
        *,
        host: str,
        python: str,
        remote_cache: PurePosixPath,
        local_cache: Path,
        unit_user: str | None = None,
        command_timeout: float = 120.0,
    ) -> None:
        self.node = node
        self.host = host
        self.python = python
        self.remote_cache = remote_cache
        self.local_cache = local_cache
        self.unit_user = unit_user
        self.command_timeout = command_timeout
        self._conn = conn
        self._real_python: str | None = None

    @classmethod
    def connect(
        cls,
        node: Node,
        connector: FabricConnector,
        *,
        python: str,
        remote_cache: PurePosixPath,
        local_cache: Path,
        connect_timeout: float = 10.0,
        unit_user: str | None = None,
    ) -> SshLauncher:
        """Open SSH to ``node`` and learn its private address; raises ``DiscoveryError`` naming the host."""
        conn = connector.connection(node, connect_timeout=connect_timeout)
        launcher = cls(
            node,
            conn,
            host=node.address,
            python=python,
            remote_cache=remote_cache,
            local_cache=local_cache,
            unit_user=unit_user,
        )
        try:
            launcher.host = launcher.private_address()
        except BaseException:
            conn.close()
            raise
        return launcher

    def close(self) -> None:
        self._conn.close()

    # --- remote commands

    def run(self, command: str, *, timeout: float | None = None, check: bool = True) -> RemoteResult:
        """Run a shell command as root on the node (through ``sudo -n`` for another SSH user)."""
        from invoke.exceptions import CommandTimedOut
        from paramiko import SSHException

        if self._conn.user != "root":
            command = "sudo -n sh -c " + shlex.quote(command)
        limit = timeout if timeout is not None else self.command_timeout
        try:
            self._conn.open()  # a no-op while connected
            # Each command opens a channel; on a link gone silent (no TCP reset) paramiko waits an hour
            # for the node's answer by default, and the command's timer starts only after that.
            self._conn.transport.channel_timeout = min(limit, POLL_TIMEOUT_S)
            res = self._conn.run(command, hide=True, warn=True, in_stream=False, timeout=max(1, int(limit)))
        except CommandTimedOut:
            raise LaunchError(
                f"node {self.node.name}: `{command[:120]}` did not finish within {limit:g}s"
            ) from None
        except (SSHException, OSError, EOFError) as exc:
            raise DiscoveryError(
                f"host {self.node.name}: SSH session failed: {exc or type(exc).__name__}"
            ) from None
        out = RemoteResult(int(res.return_code), str(res.stdout), str(res.stderr))
        if check and out.exit_code != 0:
            raise LaunchError(f"node {self.node.name}: `{command[:120]}` failed: {out.said}")
        return out

    def put_text(self, path: PurePosixPath, text: str, *, mode: int = 0o644) -> None:
        """Write ``path`` atomically with ``mode``; the file has that mode before any byte is written."""
        if self._conn.user != "root":
            # SFTP runs as the SSH user, who cannot write /etc: stage in a private dir, then install.
            stage = PurePosixPath(self.run("mktemp -d").stdout.strip()) / path.name
            self._sftp_write(stage, text, 0o600)
            self.run(f"install -D -m {mode:o} {shlex.quote(str(stage))} {shlex.quote(str(path))}")
            self.run(f"rm -rf {shlex.quote(str(stage.parent))}")
            return
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        self.run(f"mkdir -p {shlex.quote(str(path.parent))}")
        self._sftp_write(tmp, text, mode)
        self.run(f"mv -f {shlex.quote(str(tmp))} {shlex.quote(str(path))}")

    def _sftp_write(self, path: PurePosixPath, text: str, mode: int) -> None:
        from paramiko import SSHException

        try:
            sftp = self._conn.sftp()
            # Create empty with the final mode first: a secret never sits in a wider-mode file.
            sftp.putfo(io.BytesIO(b""), str(path))
            sftp.chmod(str(path), mode)
            with sftp.open(str(path), "w") as f:
                f.write(text.encode())
        except (SSHException, OSError) as exc:
            raise LaunchError(f"node {self.node.name}: cannot write {path}: {exc}") from None

    def private_address(self) -> str:
        """The IPv4 address of ``node.nic`` on the node, else ``node.address``."""
        if not self.node.nic:
            return self.node.address
        res = self.run(f"ip -4 -o addr show dev {shlex.quote(self.node.nic)}", check=False)
        match = _INET_RE.search(res.stdout)
        if res.exit_code != 0 or match is None:
            raise LaunchError(
                f"node {self.node.name}: interface {self.node.nic} has no IPv4 address ({res.said})",
                hint="fix the node's nic in the inventory (the interface carrying inter-node traffic)",
            )
        return match.group(1)

    def weights_peer(self) -> Peer | None:
        """This node as a holder of weights for :func:`~controlplane.weights.distribute.distribute`, or
        None when it is reached as a user other than root: the distribution works as root (it authorises
        its key in root's ``authorized_keys`` and nodes copy as root), so such a node gets its copy from
        here (:meth:`ensure_weights`).

        Peers reach it on its private address and on the port its sshd listens on (``sshd -T``), not
        ``node.ssh_port``: that is where this machine reaches it, possibly a forwarded port (a tunnel,
        NAT, a container host)."""
        if self._conn.user != "root":
            return None
        res = self.run("sshd -T 2>/dev/null | sed -n 's/^port //p' | head -n 1", check=False)
        port = res.stdout.strip()
        return Peer(
            name=self.node.name,
            conn=self._conn,
            private_address=self.host,
            ssh_port=int(port) if port.isdigit() else self.node.ssh_port,
            ssh_user="root",
        )

    def real_python(self) -> str:
        """The interpreter's resolved path on the node (a venv's python links to its base Python)."""
        if self._real_python is None:
            res = self.run(f"readlink -f {shlex.quote(self.python)}", check=False)
            self._real_python = res.stdout.strip() or self.python
        return self._real_python

    def _python_check(self, code: str, *args: str) -> RemoteResult:
        res = self.run(shlex.join([self.python, "-c", code, *args]), check=False)
        if res.exit_code == 127:
            raise LaunchError(
                f"node {self.node.name}: interpreter {self.python} not found",
                hint="install Sarv's venv there (the sarv_controlplane role) or set SARV_REMOTE_PYTHON",
            )
        return res

    # --- Launcher protocol

    def allocate_port(self, preferred: int | None = None) -> int:
        code = (
            "import socket,sys\n"
            "s=socket.socket()\n"
            "try:\n s.bind((sys.argv[1],int(sys.argv[2])))\n"
            "except OSError:\n sys.exit(3)\n"
            "print(s.getsockname()[1])"
        )
        res = self._python_check(code, self.host, str(preferred or 0))
        if res.exit_code == 3:
            raise LaunchError(
                f"port {preferred} on {self.node.name} ({self.host}) is already in use",
                hint="choose another --port, or stop what listens there",
            )
        if res.exit_code != 0 or not res.stdout.strip().isdigit():
            raise LaunchError(f"node {self.node.name}: cannot find a free port on {self.host}: {res.said}")
        return int(res.stdout.strip())

    def ensure_weights(
        self,
        source: str,
        model: str,
        *,
        policy: WeightsPolicy,
        progress: Callable[[str], None] | None = None,
    ) -> Path:
        """Verify ``source`` here, then land the same bytes in the node's cache and check them there."""
        local = ensure_weights(source, model, self.local_cache, policy=policy, progress=progress)
        dest = self.remote_cache / model / local.name  # the manifest digest: same bytes, same path
        qdest = shlex.quote(str(dest))
        manifest_sha256 = sha256_file(local / MANIFEST_NAME)
        if self.run(verify_command(dest, manifest_sha256), check=False).exit_code == 0:
            return Path(str(dest))
        if progress:
            progress(f"weights: copying {model} to {self.node.name}")
        work = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
        try:
            for path in sorted(p for p in local.rglob("*") if p.is_file() and not p.name.startswith(".")):
                rel = path.relative_to(local).as_posix()
                target = work / rel
                self.run(f"mkdir -p {shlex.quote(str(target.parent))}")
                try:
                    self._conn.put(str(path), str(target))
                except OSError as exc:
                    raise LaunchError(f"node {self.node.name}: cannot copy {rel}: {exc}") from None
            check = self.run(verify_command(work, manifest_sha256), check=False)
            if check.exit_code != 0:
                raise LaunchError(
                    f"node {self.node.name}: weights of {model} failed their manifest: {check.said}"
                )
            # Weights are not secret and engines may run as a dynamic user: world-readable.
            # A directory at dest failed the check above: replace it, never serve unverified bytes.
            qwork = shlex.quote(str(work))
            self.run(f"chmod -R a+rX {qwork} && rm -rf {qdest} && mv -T {qwork} {qdest}")
        finally:
            self.run(f"rm -rf {shlex.quote(str(work))}", check=False)
        return Path(str(dest))

    def start(self, replica_id: str, launch: EngineLaunch) -> dict[str, str]:
        return self.start_unit(self.engine_unit(replica_id, launch), launch)

    def engine_unit(
        self,
        replica_id: str,
        launch: EngineLaunch,
        *,
        role: str = "",
        extra_env: dict[str, str] | None = None,
        joins: str | None = None,
    ) -> UnitSpec:
        """The unit running ``launch`` on this node (``role`` names helper units like Ray's)."""
        name = unit_name(replica_id, role)
        argv = list(launch.argv)
        user = self.unit_user
        exec_stop = exec_stop_post = None
        if launch.container_name is not None:
            # systemd supervises the container: run it in the foreground (no --detach) and let
            # systemd, not dockerd, restart it, so the unit's state is the container's.
            argv = _foreground_docker(argv)
            exec_stop = [argv[0], "stop", "--time", "20", launch.container_name]
            exec_stop_post = [argv[0], "rm", "--force", launch.container_name]
            user = "root"  # the docker socket is root's; the container itself runs confined
        env_file = env_file_path(name) if launch.secret_env else None
        return UnitSpec(
            name=name,
            description=f"Sarv replica {replica_id}{' ' + role if role else ''}",
            argv=argv,
            env={**launch.env, **(extra_env or {})},
            env_file=env_file,
            user=user,
            exec_stop=exec_stop,
            exec_stop_post=exec_stop_post,
            protect_home=_protect_home(self.real_python()),
            bind_read_only=_tmp_binds(self.python),
            joins_namespace_of=joins,
            after=[joins] if joins else [],
        )

    def start_unit(self, unit: UnitSpec, launch: EngineLaunch | None = None) -> dict[str, str]:
        """Install ``unit`` (and its 0600 env file) and (re)start it; returns the replica handle."""
        if unit.env_file is not None and launch is not None:
            text = env_file_text(launch.secret_env)
            self.run(f"install -d -m 0700 {shlex.quote(str(unit.env_file.parent))}")
            self.put_text(unit.env_file, text, mode=0o600)
        try:
            self.put_text(UNIT_DIR / unit.name, render_unit(unit), mode=0o644)
            res = self.run(
                f"systemctl daemon-reload && (systemctl reset-failed {unit.name} 2>/dev/null; true) && "
                f"systemctl restart {unit.name}",
                check=False,
            )
            if res.exit_code != 0:
                # Type=exec: a missing interpreter or a sandbox refusal fails the start itself.
                why = self.last_error(unit.name) or res.said
                raise LaunchError(
                    f"node {self.node.name}: unit {unit.name} failed to start: {why}",
                    hint=f"ssh {self.node.name} journalctl -u {unit.name}",
                )
        except BaseException:
            # The deployer only rolls back what start() returned: nothing of this unit may stay.
            self.remove_unit(unit.name)
            raise
        return {
            "launcher": self.name,
            "host": self.node.name,
            "unit": unit.name,
            "env_file": str(unit.env_file or ""),
            "log": f"ssh {self.node.name} journalctl -u {unit.name}",
        }

    def last_error(self, unit: str, *, own_output: bool = False, lines: int = 20) -> str:
        """The last line of ``unit``'s journal that reads like an error (else its last line), or ''.

        With ``own_output``, what the unit's processes wrote comes first: systemd's own lines about the unit
        ("Failed with result 'exit-code'") are used only when the processes wrote nothing."""
        q = shlex.quote(unit)
        for match in ([f"_SYSTEMD_UNIT={q}"] if own_output else []) + [f"-u {q}"]:
            tail = self.run(f"journalctl {match} -n {lines} --no-pager -o cat", check=False)
            if why := last_error_line(tail.stdout.splitlines()):
                return why
        return ""

    def unit_state(self, unit: str, *, timeout: float | None = None) -> UnitState:
        res = self.run(
            "systemctl show --property=LoadState,ActiveState,SubState,ExecMainStatus,NRestarts "
            + shlex.quote(unit),
            check=False,
            timeout=timeout,
        )
        props = dict(line.partition("=")[::2] for line in res.stdout.splitlines() if "=" in line)
        status = props.get("ExecMainStatus", "")
        return UnitState(
            load=props.get("LoadState", "not-found"),
            active=props.get("ActiveState", "inactive"),
            sub=props.get("SubState", "dead"),
            exit_status=int(status) if status.isdigit() and status != "0" else None,
            restarts=int(props.get("NRestarts", "0") or 0) if props.get("NRestarts", "").isdigit() else 0,
        )

    def poll(self, handle: dict[str, str]) -> ReplicaProcess:
        unit = handle.get("unit", "")
        if not unit:
            return ReplicaProcess(state=ProcessState.GONE)
        return self.unit_state(unit, timeout=POLL_TIMEOUT_S).process

    def claim(self, replica_id: str) -> dict[str, str]:
        """The replica's unit, named from its id alone (see :func:`~controlplane.launchers.claim_handle`)."""
        return {"launcher": self.name, "host": self.node.name, "unit": unit_name(replica_id)}

    def stop(self, handle: dict[str, str], *, timeout: float = 30.0) -> None:
        unit = handle.get("unit", "")
        if unit:
            self.remove_unit(unit, timeout=timeout)

    def remove_unit(self, unit: str, *, timeout: float = 30.0) -> None:
        """Stop ``unit`` and remove every file it had; a unit that is already gone is a no-op."""
        q = shlex.quote(unit)
        env = shlex.quote(str(env_file_path(unit)))
        self.run(f"systemctl stop {q} 2>/dev/null; true", timeout=timeout + 30)
        # StateDirectory of a DynamicUser unit lives under /var/lib/private; both paths are removed.
        state = shlex.quote("sarv/" + unit.removesuffix(".service"))
        self.run(
            f"rm -f {UNIT_DIR}/{q} {env} && systemctl daemon-reload && "
            f"(systemctl reset-failed {q} 2>/dev/null; true) && "
            f"rm -rf /var/lib/{state} /var/lib/private/{state}"
        )
        if self.unit_state(unit).active in _RUNNING:
            raise LaunchError(f"node {self.node.name}: unit {unit} still runs after stop")

    def logs(self, handle: dict[str, str], *, follow: bool = False, tail: int = 200) -> Iterator[str]:
        unit = handle.get("unit", "")
        if not unit:
            return
        base = f"journalctl --unit {shlex.quote(unit)} --no-pager --output cat --show-cursor"
        res = self.run(f"{base} --lines {max(0, tail) or 'all'}", check=False)
        cursor = yield from _journal_lines(res.stdout)
        # Follow by polling with the journal cursor until the unit stops (like `tail -f --pid`).
        while follow and self.unit_state(unit).process.state is ProcessState.RUNNING:
            time.sleep(1.0)
            after = f" --after-cursor {shlex.quote(cursor)}" if cursor else ""
            cursor = (yield from _journal_lines(self.run(base + after, check=False).stdout)) or cursor


def _journal_lines(text: str) -> Generator[str, None, str]:
    """Yield journal lines; return the ``-- cursor: …`` that ``--show-cursor`` appends."""
    cursor = ""
    for line in text.splitlines():
        if line.startswith("-- cursor: "):
            cursor = line.removeprefix("-- cursor: ")
        elif line != "-- No entries --":
            yield line
    return cursor


def _protect_home(python: str) -> str:
    """``ProtectHome=yes`` hides /root and /home; keep them read-only when the interpreter lives there."""
    return "read-only" if python.startswith(("/root/", "/home/")) else "yes"


def _tmp_binds(python: str) -> list[str]:
    """``DynamicUser=yes`` implies ``PrivateTmp=yes``, which hides a venv living under /tmp (a checkout
    there, as CI may use): bind that checkout read-only into the unit. Installed nodes use
    /opt/sarv/venv and bind nothing."""
    for root in ("/tmp/", "/var/tmp/"):  # noqa: S108 - a path test, nothing is written there
        if python.startswith(root):
            top = python[len(root) :].split("/", 1)[0]
            return [root + top] if top else []
    return []


def _foreground_docker(argv: list[str]) -> list[str]:
    """``docker run`` argv without ``--detach`` and ``--restart``: systemd supervises and restarts."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in {"--detach", "-d"}:
            continue
        if arg == "--restart":
            skip = True
            continue
        if arg.startswith("--restart="):
            continue
        out.append(arg)
    return out
