"""Replicas on remote hosts over real SSH: systemd units in Debian containers, deployed and removed.

Fixtures (tests/remote/conftest.py) mount this checkout into the hosts, so the units run the code under
test; GPUs are declared by a fake ``nvidia-smi`` and discovered over SSH.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fixtures.common import free_port
from fixtures.gateway import chat
from fixtures.testhosts import TestHost

from controlplane.errors import DiscoveryError, LaunchError
from controlplane.settings import Settings
from controlplane.spec import DeploymentSpec, EngineKind, Fleet, Node

pytestmark = [pytest.mark.ssh, pytest.mark.docker, pytest.mark.slow]

_HARDENING = [
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "PrivateTmp=yes",
    "DynamicUser=yes",
    "CapabilityBoundingSet=",
    "EnvironmentFile=/etc/sarv/replicas/sarv-web-0.env",
]


def _discovered(hosts: list[TestHost], nodes: list[Node]) -> Fleet:
    from controlplane.fleet import discover_fleet
    from controlplane.remote import FabricConnector

    return discover_fleet(Fleet(nodes=nodes), connector=FabricConnector(key_filename=hosts[0].key_path))


def test_sim_replicas_run_as_hardened_units_and_undeploy_removes_them(
    remote_hosts: list[TestHost], remote_nodes: list[Node], wired: Callable[..., Any]
) -> None:
    fleet = _discovered(remote_hosts, remote_nodes)
    assert [n.gpu_model for n in fleet.nodes] == ["L4", "L4"]
    w = wired(fleet)
    spec = DeploymentSpec(name="web", model="sarv-tiny", replicas=2, engine=EngineKind.SIM)
    result = w.deployer.deploy(spec, timeout=120)
    assert result.changed
    engine_key = w.store.get_engine_key("web")
    assert engine_key is not None
    secret = engine_key.get_secret_value()
    by_node = {r.node: r for r in result.replicas}
    assert sorted(by_node) == [h.name for h in remote_hosts]
    for host in remote_hosts:
        rec = by_node[host.name]
        assert rec.state.value == "ready"
        assert rec.handle["launcher"] == "ssh"
        # Engines listen on the node's private address (its nic), never on 0.0.0.0 or loopback.
        assert rec.endpoint is not None and rec.endpoint.startswith(f"http://{host.ip}:")
        resp = chat(rec.endpoint, secret, "web")
        assert resp.status_code == 200, resp.text
        unit = rec.handle["unit"]
        text = host.exec(f"cat /etc/systemd/system/{unit}").stdout
        for line in _HARDENING:
            assert line.replace("web-0", rec.id) in text.splitlines(), line
        assert secret not in text
        assert host.exec(f"systemctl is-active {unit}").stdout.strip() == "active"
        env_file = rec.handle["env_file"]
        assert host.exec(f"stat -c '%a %U' {env_file}").stdout.split() == ["600", "root"]
        # The secret is in no process list on the node.
        assert secret not in host.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
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
    wired: Callable[..., Any],
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
    remote_hosts: list[TestHost], remote_nodes: list[Node], wired: Callable[..., Any]
) -> None:
    fleet = Fleet(nodes=remote_nodes)
    w = wired(fleet)
    # An option the simulator refuses: its process exits at once on one node, and the whole deploy
    # (the healthy replica on the other node too) is rolled back.
    spec = DeploymentSpec(
        name="bad", model="sarv-tiny", replicas=2, engine=EngineKind.SIM, engine_args={"no_such_flag": 1}
    )
    with pytest.raises(LaunchError, match="rolled back") as err:
        w.deployer.deploy(spec, timeout=60)
    assert "bad-" in str(err.value)
    # Why it exited, from the process's own output, not systemd's "Failed with result 'exit-code'" after it.
    assert "error: unrecognized arguments: --no-such-flag 1" in str(err.value), str(err.value)
    assert w.store.list_deployments() == [] and w.store.list_replicas() == []
    for host in remote_hosts:
        assert host.exec("ls /etc/systemd/system | grep '^sarv-' || true").stdout.strip() == ""


def test_missing_remote_interpreter_is_a_clear_error(
    remote_nodes: list[Node], remote_settings: Settings, wired: Callable[..., Any]
) -> None:
    bad = remote_settings.model_copy(update={"remote_python": "/opt/nowhere/bin/python"})
    w = wired(Fleet(nodes=remote_nodes[:1]), settings=bad)
    spec = DeploymentSpec(name="nopy", model="sarv-tiny", engine=EngineKind.SIM)
    with pytest.raises(LaunchError, match=r"node remote-\d+: interpreter /opt/nowhere/bin/python not found"):
        w.deployer.deploy(spec, timeout=30)
    assert w.store.list_deployments() == [] and w.store.list_replicas() == []
