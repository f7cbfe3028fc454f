"""Multi-node pipeline parallelism: a Ray cluster per replica (head on pp rank 0, workers on the rest)."""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath

from controlplane.engines.base import EngineLaunch
from controlplane.errors import LaunchError, SarvError
from controlplane.launchers.base import ProcessState, ReplicaProcess
from controlplane.launchers.ssh import SshLauncher
from controlplane.launchers.units import UnitSpec, unit_name
from controlplane.weights import WeightsPolicy

__all__ = ["RayLauncher", "ray_active_nodes", "ray_engine_argv"]

_ACTIVE_NODE_RE = re.compile(r"^\s*\d+\s+node_[0-9a-f]+", re.MULTILINE)


def ray_active_nodes(status_text: str) -> int:
    """Nodes listed under ``Active:`` in ``ray status`` output (those that joined and are alive)."""
    section = status_text.partition("Active:")[2].partition("Pending:")[0]
    return len(_ACTIVE_NODE_RE.findall(section))


def ray_engine_argv(argv: Sequence[str]) -> list[str]:
    """The engine's argv as the Ray head runs it: pipeline stages on other nodes need Ray's executor."""
    out = list(argv)
    if "--pipeline-parallel-size" in out and "--distributed-executor-backend" not in out:
        out += ["--distributed-executor-backend", "ray"]
    return out


class RayLauncher:
    """Runs one replica across nodes: ``ray start --head`` on the pp-rank-0 node, ``ray start --address``
    on the others (each a hardened systemd unit), then the engine on the head node with
    ``--distributed-executor-backend ray``.

    Each replica gets its own Ray cluster, in its own units: stopping one never touches another's
    (``ray stop`` would kill every Ray process of the user on the node, so it is never used). Inter-node
    traffic is pinned to each node's ``nic`` through ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME``.
    Ray's GCS listens on all interfaces whatever ``--node-ip-address`` says: the nodes must sit on a
    private network (docs/remote.md).
    """

    name = "ray"

    def __init__(
        self,
        stages: Sequence[SshLauncher],
        *,
        ray_version: str | None = None,
        join_timeout: float = 180.0,
        object_store_bytes: int = 256 * 1024 * 1024,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if len(stages) < 2:
            raise LaunchError("a Ray cluster needs at least two nodes; a single node runs the engine alone")
        self.stages = list(stages)
        self.host = stages[0].host
        self.python = stages[0].python
        self.ray_version = ray_version
        self.join_timeout = join_timeout
        self.object_store_bytes = object_store_bytes
        self._clock = clock
        self._sleep = sleep

    @property
    def head(self) -> SshLauncher:
        return self.stages[0]

    def _stage(self, node: str) -> SshLauncher:
        for s in self.stages:
            if s.node.name == node:
                return s
        raise LaunchError(f"node {node} is not one of this replica's nodes")

    def _ray(self, stage: SshLauncher) -> str:
        # The `ray` console script of the same venv as the interpreter, so the versions match.
        return str(PurePosixPath(stage.python).parent / "ray")

    def _nic_env(self, stage: SshLauncher) -> dict[str, str]:
        env = {"VLLM_HOST_IP": stage.host, "RAY_USAGE_STATS_ENABLED": "0"}
        if stage.node.nic:
            env |= {"NCCL_SOCKET_IFNAME": stage.node.nic, "GLOO_SOCKET_IFNAME": stage.node.nic}
        return env

    # --- Launcher protocol

    def allocate_port(self, preferred: int | None = None) -> int:
        return self.head.allocate_port(preferred)

    def ensure_weights(
        self,
        source: str,
        model: str,
        *,
        policy: WeightsPolicy,
        progress: Callable[[str], None] | None = None,
    ) -> Path:
        """Every stage loads its layers from its own node: the same verified bytes land on all of them."""
        paths = {s.ensure_weights(source, model, policy=policy, progress=progress) for s in self.stages}
        if len(paths) != 1:
            raise LaunchError(f"weights of {model} landed at different paths: {sorted(map(str, paths))}")
        return paths.pop()

    def check_ray(self) -> None:
        """Every node has Ray in the same venv as the engine, all at one version (the pinned one if set)."""
        seen: dict[str, str] = {}
        for s in self.stages:
            res = s.run(shlex.join([s.python, "-c", "import ray; print(ray.__version__)"]), check=False)
            if res.exit_code != 0:
                raise LaunchError(
                    f"node {s.node.name}: Ray is not installed in {s.python}",
                    hint=f'pip install "ray[default]=={self.ray_version or "<version>"}" into that venv',
                )
            found = res.stdout.strip()
            if self.ray_version and found != self.ray_version:
                raise LaunchError(
                    f"node {s.node.name}: Ray {found} installed, the engine needs {self.ray_version}",
                    hint="every node of a Ray cluster must run the same Ray version (settings.ray_version)",
                )
            seen[s.node.name] = found
        if len(set(seen.values())) > 1:
            versions = ", ".join(f"{node} {version}" for node, version in seen.items())
            raise LaunchError(
                f"the nodes of one Ray cluster run different Ray versions: {versions}",
                hint="install the same Ray on every node (pip install -e '.[ray]' pins it)",
            )

    def start(self, replica_id: str, launch: EngineLaunch) -> dict[str, str]:
        # Container engines run Ray from their image (its own version); process engines the node venv's.
        containers = bool(launch.ray_member_argv)
        if not containers:
            self.check_ray()
        started: list[tuple[SshLauncher, str]] = []
        try:
            gcs_port = self.head.allocate_port()
            address = f"{self.head.host}:{gcs_port}"
            head_unit = self._ray_unit(
                self.head,
                replica_id,
                "ray-head",
                ["--head", "--port", str(gcs_port), "--include-dashboard=false"],
                launch,
            )
            self.head.start_unit(head_unit)
            started.append((self.head, head_unit.name))
            head_container = head_unit.name.removesuffix(".service") if containers else None
            self.wait_joined(address, 1, container=head_container, members=started)
            for stage in self.stages[1:]:
                unit = self._ray_unit(stage, replica_id, "ray-worker", ["--address", address], launch)
                stage.start_unit(unit)
                started.append((stage, unit.name))
            self.wait_joined(address, len(self.stages), container=head_container, members=started)

            driver_env = {"RAY_ADDRESS": address, **self._nic_env(self.head)}
            if containers:
                # The driver is a container too: its environment goes in as --env, not the unit's.
                argv = _with_container_env(list(launch.argv), driver_env)
                engine = self.head.engine_unit(replica_id, launch.model_copy(update={"argv": argv}))
            else:
                engine = self.head.engine_unit(
                    replica_id,
                    launch.model_copy(update={"argv": ray_engine_argv(launch.argv)}),
                    extra_env=driver_env,
                    # The engine is a Ray driver: it needs the head's session files in the head's /tmp.
                    joins=head_unit.name,
                )
            handle = self.head.start_unit(engine, launch)
            started.append((self.head, engine.name))
        except BaseException as exc:
            errors = self._remove(reversed(started))
            if errors and isinstance(exc, SarvError):
                raise LaunchError(f"{exc.message}; cleanup also failed: {'; '.join(errors)}") from None
            raise
        units: dict[str, list[str]] = {}
        for stage, unit_ in started:
            units.setdefault(stage.node.name, []).append(unit_)
        return {
            **handle,
            "launcher": self.name,
            "nodes": ",".join(s.node.name for s in self.stages),
            "units": json.dumps(units, sort_keys=True),
            "order": json.dumps([[s.node.name, u] for s, u in started]),
            "ray_address": address,
        }

    def claim(self, replica_id: str) -> dict[str, str]:
        """:meth:`start`'s units for ``replica_id`` in its start order, named from the id alone (see
        :func:`~controlplane.launchers.claim_handle`); :meth:`stop` removes them in reverse, and a unit
        that never started is a no-op."""
        head = self.head.node.name
        order = [
            [head, unit_name(replica_id, "ray-head")],
            *([s.node.name, unit_name(replica_id, "ray-worker")] for s in self.stages[1:]),
            [head, unit_name(replica_id)],
        ]
        return {
            "launcher": self.name,
            "host": head,
            "unit": unit_name(replica_id),
            "order": json.dumps(order),
        }

    def _ray_unit(
        self, stage: SshLauncher, replica_id: str, role: str, args: list[str], launch: EngineLaunch
    ) -> UnitSpec:
        """A cluster member; on a GPU plan it offers exactly its stage's GPUs (and sees only those)."""
        gpus = launch.stage_gpus.get(stage.node.name)
        env = self._nic_env(stage)
        if gpus:
            args = [*args, "--num-gpus", str(len(gpus))]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        start = [
            "start",
            "--block",  # stay in the foreground, so systemd supervises the cluster member
            "--node-ip-address",
            stage.host,
            "--disable-usage-stats",
            "--object-store-memory",
            str(self.object_store_bytes),
            *args,
        ]
        if not launch.ray_member_argv:
            member = EngineLaunch(argv=[self._ray(stage), *start], env=env, port=1)
            return stage.engine_unit(replica_id, member, role=role)
        if not gpus:
            raise LaunchError(f"node {stage.node.name}: the plan gives replica {replica_id} no GPUs there")
        name = unit_name(replica_id, role).removesuffix(".service")
        template = [
            a.replace("{name}", name).replace("{gpus}", ",".join(gpus)) for a in launch.ray_member_argv
        ]
        env.pop("CUDA_VISIBLE_DEVICES")  # inside the container, --gpus already shows only these
        argv = _with_container_env(template, env) + start
        return stage.engine_unit(replica_id, EngineLaunch(argv=argv, port=1, container_name=name), role=role)

    def wait_joined(
        self,
        address: str,
        count: int,
        *,
        container: str | None = None,
        members: Sequence[tuple[SshLauncher, str]] = (),
    ) -> None:
        """Wait until ``ray status`` lists ``count`` alive nodes (asked inside the head member's container
        for container engines). When it does not in time, the error names each of ``members`` (the member
        units started so far) that restarted or stopped, with the last error its journal shows."""
        deadline = self._clock() + self.join_timeout
        ray = ["docker", "exec", container, "ray"] if container else [self._ray(self.head)]
        cmd = shlex.join([*ray, "status", "--address", address])
        last = ""
        while True:
            res = self.head.run(f"HOME=/tmp {cmd}", check=False, timeout=60)
            if res.exit_code == 0 and ray_active_nodes(res.stdout) >= count:
                return
            last = res.said if res.exit_code else f"{ray_active_nodes(res.stdout)} of {count} nodes joined"
            if self._clock() > deadline:
                waited = f"{self.join_timeout:.0f}s"
                message = f"Ray cluster at {address} did not reach {count} nodes in {waited}: {last}"
                troubled = list(_troubled_members(members))
                if not troubled:
                    raise LaunchError(
                        message, hint="check that the nodes reach each other on their nic (firewall, MTU)"
                    )
                stage, unit, _ = troubled[0]
                raise LaunchError(
                    "; ".join([message, *(said for _, _, said in troubled)]),
                    hint=f"ssh {stage.node.name} journalctl -u {unit} (members are restarted until "
                    "ray_join_timeout_s; a slow node may need more)",
                )
            self._sleep(2.0)

    def poll(self, handle: dict[str, str]) -> ReplicaProcess:
        """Running only while every unit on every node runs: one failed shard fails the replica.

        Restarts count for the engine only. Ray gives a joining raylet a fixed 30 s to register, which an
        overloaded node can miss; systemd's restart then retries the join, and ``wait_joined`` bounds it.
        """
        restarts = 0
        for node, unit in _order(handle):
            proc = self._stage(node).unit_state(unit).process
            if unit == handle.get("unit"):
                restarts = proc.restarts
            if proc.state is not ProcessState.RUNNING:
                return ReplicaProcess(
                    state=ProcessState.EXITED if proc.state is ProcessState.EXITED else ProcessState.GONE,
                    exit_code=proc.exit_code,
                    restarts=restarts,
                    detail=f"{unit} on {node}: {proc.detail or proc.state.value}",
                )
        return ReplicaProcess(state=ProcessState.RUNNING, restarts=restarts)

    def stop(self, handle: dict[str, str], *, timeout: float = 30.0) -> None:
        """Engine first, then workers, then the head: the reverse of the start order."""
        errors = self._remove(reversed([(self._stage(n), u) for n, u in _order(handle)]), timeout=timeout)
        if errors:
            raise LaunchError(f"replica {handle.get('unit', '?')}: teardown incomplete: {'; '.join(errors)}")

    def _remove(
        self,
        units: Iterator[tuple[SshLauncher, str]] | Sequence[tuple[SshLauncher, str]],
        *,
        timeout: float = 30.0,
    ) -> list[str]:
        errors: list[str] = []
        for stage, unit in units:
            try:
                stage.remove_unit(unit, timeout=timeout)
            except SarvError as exc:  # keep going: every other unit must still be removed
                errors.append(str(exc))
        return errors

    def logs(self, handle: dict[str, str], *, follow: bool = False, tail: int = 200) -> Iterator[str]:
        """The engine's journal; then, for any Ray unit that is down, its last lines (the likely cause)."""
        yield from self.head.logs(handle, follow=follow, tail=tail)
        for node, unit in _order(handle):
            stage = self._stage(node)
            if unit == handle.get("unit") or stage.unit_state(unit).process.state is ProcessState.RUNNING:
                continue
            for line in stage.logs({"unit": unit}, tail=min(tail, 40)):
                yield f"[{unit} on {node}] {line}"


def _with_container_env(argv: list[str], env: dict[str, str]) -> list[str]:
    """``docker run`` argv with ``--env K=V`` added before ``--entrypoint`` (or the image)."""
    at = argv.index("--entrypoint") if "--entrypoint" in argv else len(argv) - 1
    flags = [a for key, value in sorted(env.items()) for a in ("--env", f"{key}={value}")]
    return [*argv[:at], *flags, *argv[at:]]


def _order(handle: dict[str, str]) -> list[tuple[str, str]]:
    raw = json.loads(handle.get("order", "[]") or "[]")
    return [(str(n), str(u)) for n, u in raw] if isinstance(raw, list) else []


def _troubled_members(members: Sequence[tuple[SshLauncher, str]]) -> Iterator[tuple[SshLauncher, str, str]]:
    """Each member unit that systemd restarted or that no longer runs, with a line saying how and why."""
    for stage, unit in members:
        try:
            proc = stage.poll({"unit": unit})
            if proc.state is ProcessState.RUNNING and not proc.restarts:
                continue
            if proc.restarts:
                how = f"restarted {proc.restarts} time{'s' if proc.restarts > 1 else ''}"
            elif proc.state is ProcessState.GONE:
                how = "is gone"
            else:
                how = f"stopped ({proc.detail})"
            why = stage.last_error(unit, own_output=True)
        except SarvError as exc:  # an unreachable node is itself the reason
            how, why = "could not be asked", exc.message
        yield stage, unit, f"node {stage.node.name}: {unit} {how}" + (f", last: {why}" if why else "")
