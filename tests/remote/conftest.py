"""Fixtures for the remote-launcher tests: two container hosts running this checkout's code over SSH.

The containers get the checkout, its venv and the base interpreter mounted read-only at the same paths
(derived from the repository and ``sys.prefix``, not hard-coded), so remote units run the code under test.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixtures.testhosts import ONE_GPU_TOPO, TestHost, checkout_volumes, l4_query

from controlplane.launchers.ssh import SshLauncher
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, Fleet, ModelSpec, Node, Plan, Shard


@pytest.fixture(scope="session")
def remote_hosts(testhost_factory: Callable[..., list[TestHost]]) -> list[TestHost]:
    """Two hosts with one declared L4 GPU each (fake nvidia-smi)."""
    hosts = testhost_factory(2, prefix="remote", volumes=checkout_volumes())
    for i, host in enumerate(hosts):
        # Test-only: /root is 0700 in the image; the unprivileged dynamic unit user must traverse it to
        # reach the interpreter mounted below it. Real nodes run Sarv's venv from /opt/sarv.
        host.exec("chmod 0711 /root")
        host.set_fake_gpus(l4_query(f"GPU-0000000{i}-aaaa-bbbb-cccc-000000000000"), ONE_GPU_TOPO)
    # In the order the planner and the store list nodes (by name): remote-10 comes before remote-9.
    return sorted(hosts, key=lambda h: h.name)


@pytest.fixture
def remote_nodes(remote_hosts: list[TestHost]) -> list[Node]:
    """The hosts as inventory nodes: SSH on a loopback port, inter-node traffic on eth0."""
    return [
        Node(name=h.name, address=h.address, ssh_port=h.ssh_port, ssh_user=h.user, nic="eth0")
        for h in remote_hosts
    ]


@pytest.fixture
def remote_settings(tmp_path: Path, remote_hosts: list[TestHost]) -> Settings:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ray_version = version("ray")
    except PackageNotFoundError:
        ray_version = "not-installed"
    return Settings(
        home=tmp_path / "home",
        remote_python=sys.executable,
        ssh_key_file=remote_hosts[0].key_path,
        remote_model_cache=Path("/var/lib/sarv/models"),
        ray_version=ray_version,
    )


def cpu_planner(fleet: Fleet, spec: DeploymentSpec, model: ModelSpec, placed: list[Shard]) -> Plan:
    from controlplane import placement
    from controlplane.launchers import is_local_node

    return placement.place(fleet, spec, model, placed, is_local=is_local_node)


class Wired:
    """A Deployer on real SSH (and Ray) launchers with SQLite state; closes connections at the end."""

    def __init__(self, settings: Settings, fleet: Fleet, planner: Callable[..., Plan] = cpu_planner) -> None:
        from controlplane.catalog import Catalog
        from controlplane.controller import Deployer, default_engines
        from controlplane.launchers import group_launcher_for, launcher_for
        from controlplane.launchers.ray import RayLauncher
        from controlplane.state import open_store  # type: ignore[attr-defined]

        self.ssh: list[SshLauncher] = []
        cache = settings.resolved_model_cache

        def factory(node: Node) -> object:
            launcher = launcher_for(node, settings.home, cache, settings)
            if isinstance(launcher, SshLauncher):
                self.ssh.append(launcher)
            return launcher

        def group_factory(nodes: list[Node]) -> object:
            launcher = group_launcher_for(nodes, cache, settings)
            if isinstance(launcher, RayLauncher):
                self.ssh.extend(launcher.stages)
            return launcher

        self.store = open_store(settings.resolved_state_url, settings)
        self.deployer = Deployer(
            settings=settings,
            store=self.store,
            fleet=fleet,
            catalog=Catalog.load(settings.catalog),
            planner=planner,
            launcher_factory=factory,  # type: ignore[arg-type]
            group_launcher_factory=group_factory,  # type: ignore[arg-type]
            engines=default_engines(settings),
        )

    def close(self) -> None:
        for launcher in self.ssh:
            launcher.close()
        self.store.close()


@pytest.fixture
def wired(remote_settings: Settings, remote_hosts: list[TestHost]) -> Iterator[Callable[..., Wired]]:
    """``make(fleet, planner=cpu_planner, settings=None)``; afterwards every deployment is undeployed and
    no ``sarv-*`` unit may be left on any host."""
    made: list[Wired] = []

    def make(
        fleet: Fleet, planner: Callable[..., Plan] = cpu_planner, settings: Settings | None = None
    ) -> Wired:
        w = Wired(settings or remote_settings, fleet, planner)
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
