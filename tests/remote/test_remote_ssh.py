"""Replicas on remote hosts over real SSH: systemd units in Debian containers, deployed and removed.

The containers get this checkout and its Python mounted read-only at the same paths, so the remote
units run the very code under test. GPUs are declared by a fake ``nvidia-smi`` and discovered over SSH.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fixtures.common import REPO, free_port
from fixtures.testhosts import TestHost

from controlplane.errors import DiscoveryError, LaunchError
from controlplane.launchers.ssh import SshLauncher
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, EngineKind, Fleet, ModelSpec, Node, Plan, ReplicaRecord

pytestmark = [pytest.mark.ssh, pytest.mark.docker, pytest.mark.slow]

_QUERY = "0, GPU-{uuid}, NVIDIA L4, 23034, 0, 00000000:01:00.0\n"
_TOPO = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-1\t0\t\tN/A\n"
_HARDENING = [
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "PrivateTmp=yes",
    "DynamicUser=yes",
    "CapabilityBoundingSet=",
    "EnvironmentFile=/etc/sarv/replicas/sarv-web-0.env",
]


def remote_volumes() -> list[str]:
    """The checkout, its venv and the base interpreter, read-only at the same paths in the hosts."""
    paths = {REPO, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    # Drop paths already inside another mounted one.
    keep = [p for p in paths if not any(p != q and p.is_relative_to(q) for q in paths)]
    return [f"{p}:{p}:ro" for p in sorted(keep)]


def prepare_host(host: TestHost) -> None:
    # Test-only: /root is 0700 in the image; a dynamic (unprivileged) unit user must traverse it to
    # reach the interpreter mounted below it. A real node runs Sarv's venv from /opt/sarv.
    host.exec("chmod 0711 /root")
    host.set_fake_gpus(_QUERY.format(uuid=f"0000000{host.name[-1]}-aaaa-bbbb-cccc-000000000000"), _TOPO)


@pytest.fixture(scope="module")
def remote_hosts(testhost_factory: Callable[..., list[TestHost]]) -> list[TestHost]:
    hosts = testhost_factory(2, prefix="remote", volumes=remote_volumes())
    for h in hosts:
        prepare_host(h)
    return hosts


def _node(host: TestHost, **extra: object) -> Node:
    return Node(
        name=host.name,
        address=host.address,
        ssh_port=host.ssh_port,
        ssh_user=host.user,
        nic="eth0",
        **extra,  # type: ignore[arg-type]
    )


@pytest.fixture
def settings(tmp_path: Path, remote_hosts: list[TestHost]) -> Settings:
    return Settings(
        home=tmp_path / "home",
        remote_python=sys.executable,
        ssh_key_file=remote_hosts[0].key_path,
        remote_model_cache=Path("/var/lib/sarv/models"),
    )


class Wired:
    """A Deployer on real SSH launchers; closes their connections at the end."""

    def __init__(self, settings: Settings, fleet: Fleet) -> None:
        from controlplane.catalog import Catalog
        from controlplane.controller import Deployer, default_engines
        from controlplane.launchers import launcher_for
        from controlplane.state import open_store  # type: ignore[attr-defined]

        self.launchers: list[object] = []

        def factory(node: Node) -> object:
            launcher = launcher_for(node, settings.home, settings.resolved_model_cache, settings)
            self.launchers.append(launcher)
            return launcher

        self.store = open_store(settings.resolved_state_url, settings)
        self.deployer = Deployer(
            settings=settings,
            store=self.store,
            fleet=fleet,
            catalog=Catalog.load(settings.catalog),
            planner=_planner,
            launcher_factory=factory,  # type: ignore[arg-type]
            engines=default_engines(settings),
            python=settings.remote_python,
        )

    def close(self) -> None:
        for launcher in self.launchers:
            if isinstance(launcher, SshLauncher):
                launcher.close()
        self.store.close()


def _planner(fleet: Fleet, spec: DeploymentSpec, model: ModelSpec, placed: list[ReplicaRecord]) -> Plan:
    from controlplane import placement

    return placement.plan(fleet, spec, model, [s for r in placed for s in r.shards])


@pytest.fixture
def wired(settings: Settings, remote_hosts: list[TestHost]) -> Iterator[Callable[[Fleet], Wired]]:
    made: list[Wired] = []

    def make(fleet: Fleet) -> Wired:
        w = Wired(settings, fleet)
        made.append(w)
        return w

    yield make
    for w in made:
        for dep in w.store.list_deployments():
            w.deployer.undeploy(dep.name)
        w.close()
    for h in remote_hosts:
        left = h.exec("ls /etc/systemd/system | grep '^sarv-' || true").stdout.split()
        assert not left, f"units left on {h.name}: {left}"


def _discovered(hosts: list[TestHost]) -> Fleet:
    from controlplane.fleet.discovery import FabricConnector, discover_fleet

    declared = Fleet(nodes=[_node(h) for h in hosts])
    return discover_fleet(declared, connector=FabricConnector(key_filename=hosts[0].key_path))


def test_sim_replicas_run_as_hardened_units_and_undeploy_removes_them(
    remote_hosts: list[TestHost], wired: Callable[[Fleet], Wired]
) -> None:
    fleet = _discovered(remote_hosts)
    assert [n.gpu_model for n in fleet.nodes] == ["L4", "L4"]
    w = wired(fleet)
    from pydantic import SecretStr

    w.deployer.api_key = SecretStr("sk-remote-secret-123")
    spec = DeploymentSpec(name="web", model="sarv-tiny", replicas=2, engine=EngineKind.SIM)
    result = w.deployer.deploy(spec, timeout=120)
    assert result.changed
    by_node = {r.node: r for r in result.replicas}
    assert sorted(by_node) == [h.name for h in remote_hosts]
    for host in remote_hosts:
        rec = by_node[host.name]
        assert rec.state.value == "ready"
        assert rec.handle["launcher"] == "ssh"
        # Engines listen on the node's private address (its nic), never on 0.0.0.0 or loopback.
        assert rec.endpoint is not None and rec.endpoint.startswith(f"http://{host.ip}:")
        resp = httpx.post(
            f"{rec.endpoint}/v1/chat/completions",
            headers={"Authorization": "Bearer sk-remote-secret-123"},
            json={"model": "web", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert resp.status_code == 200, resp.text
        unit = rec.handle["unit"]
        text = host.exec(f"cat /etc/systemd/system/{unit}").stdout
        for line in _HARDENING:
            assert line.replace("web-0", rec.id) in text.splitlines(), line
        assert "sk-remote-secret" not in text
        assert host.exec(f"systemctl is-active {unit}").stdout.strip() == "active"
        env_file = rec.handle["env_file"]
        assert host.exec(f"stat -c '%a %U' {env_file}").stdout.split() == ["600", "root"]
        # The secret is in no process list on the node.
        assert "sk-remote-secret" not in host.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        # The process runs as an unprivileged dynamic user, sandboxed by systemd.
        pid = host.exec(f"systemctl show -p MainPID --value {unit}").stdout.strip()
        assert host.exec(f"stat -c %u /proc/{pid}").stdout.strip() != "0"
        assert "NoNewPrivs:\t1" in host.exec(f"cat /proc/{pid}/status").stdout

    again = w.deployer.deploy(spec, timeout=60)
    assert not again.changed
    assert [r.handle for r in again.replicas] == [r.handle for r in result.replicas]

    logs = list(w.deployer.logs(result.replicas[0].id, tail=50))
    assert logs, "journal lines of the replica"

    stopped = w.deployer.undeploy("web")
    assert sorted(stopped) == ["web-0", "web-1"]
    for host in remote_hosts:
        assert host.exec("ls /etc/systemd/system | grep '^sarv-' || true").stdout.strip() == ""
        assert host.exec("ls /etc/sarv/replicas").stdout.strip() == ""
        assert host.exec("systemctl list-units --all --plain --no-legend 'sarv-*'").stdout.strip() == ""
    assert w.store.list_deployments() == [] and w.store.list_replicas() == []


def test_unreachable_host_fails_with_one_line_naming_it_and_records_nothing(
    remote_hosts: list[TestHost], wired: Callable[[Fleet], Wired]
) -> None:
    dead = Node(name="ghost", address="127.0.0.1", ssh_port=free_port(), ssh_user="root", nic="eth0")
    fleet = Fleet(nodes=[dead])
    w = wired(fleet)
    spec = DeploymentSpec(name="lost", model="sarv-tiny", engine=EngineKind.SIM)
    with pytest.raises(DiscoveryError) as err:
        w.deployer.deploy(spec, timeout=30)
    assert "host ghost" in str(err.value) and "\n" not in str(err.value)
    assert err.value.exit_code == 4
    assert w.store.list_deployments() == [] and w.store.list_replicas() == []


def test_engine_crash_at_start_rolls_back_every_replica(
    remote_hosts: list[TestHost], wired: Callable[[Fleet], Wired]
) -> None:
    fleet = Fleet(nodes=[_node(h) for h in remote_hosts])
    w = wired(fleet)
    # An option the simulator refuses: its process exits at once on one node, and the whole deploy
    # (the healthy replica on the other node too) is rolled back.
    spec = DeploymentSpec(
        name="bad", model="sarv-tiny", replicas=2, engine=EngineKind.SIM, engine_args={"no_such_flag": 1}
    )
    with pytest.raises(LaunchError, match="rolled back") as err:
        w.deployer.deploy(spec, timeout=60)
    assert "bad-" in str(err.value)
    assert w.store.list_deployments() == [] and w.store.list_replicas() == []
    for host in remote_hosts:
        assert host.exec("ls /etc/systemd/system | grep '^sarv-' || true").stdout.strip() == ""


def test_missing_remote_interpreter_is_a_clear_error(
    remote_hosts: list[TestHost], settings: Settings, wired: Callable[[Fleet], Wired]
) -> None:
    bad = settings.model_copy(update={"remote_python": "/opt/nowhere/bin/python"})
    w = Wired(bad, Fleet(nodes=[_node(remote_hosts[0])]))
    try:
        spec = DeploymentSpec(name="nopy", model="sarv-tiny", engine=EngineKind.SIM)
        with pytest.raises(
            LaunchError, match=r"node remote-\d+: interpreter /opt/nowhere/bin/python not found"
        ):
            w.deployer.deploy(spec, timeout=30)
        assert w.store.list_deployments() == []
    finally:
        w.close()
