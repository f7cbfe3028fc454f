"""Real state after converging sarv.redis_cluster on one host: six instances forming one healthy cluster."""

import re
import shlex

import pytest

PORTS = range(7000, 7006)


@pytest.fixture(scope="module")
def cfg(host):
    return host.ansible.get_variables()


@pytest.fixture(scope="module")
def addr(host):
    return host.interface.default().addresses[0]


def cli(host, addr, user, password, *args, port=7000):
    """redis-cli as an ACL user; the password goes through stdin (--askpass), never argv."""
    cmd = " ".join(
        shlex.quote(a)
        for a in ["redis-cli", "-c", "-h", addr, "-p", str(port), "--user", user, "--askpass", *args]
    )
    return host.run(f"printf '%s\\n' {shlex.quote(password)} | {cmd}")


def test_packages(host):
    assert host.package("redis-server").is_installed
    assert host.package("redis-tools").is_installed


def test_default_standalone_server_is_masked(host):
    svc = host.service("redis-server")
    assert not svc.is_running
    assert svc.is_masked


@pytest.mark.parametrize("port", PORTS)
def test_instance_config_file(host, cfg, port):
    f = host.file(f"/etc/redis/redis-{port}.conf")
    assert (f.user, f.group, f.mode) == ("root", "redis", 0o640)
    text = f.content_string
    assert "Ansible managed" in text
    assert "\ncluster-enabled yes" in text
    assert "\nappendonly yes" in text
    assert "\nprotected-mode yes" in text
    assert "\nuser default reset" in text
    # users' passwords are stored as hashes, not in clear
    assert cfg["redis_cluster_gateway_password"] not in text
    assert cfg["redis_cluster_admin_password"] not in text


@pytest.mark.parametrize("port", PORTS)
def test_instance_running_on_private_address_only(host, addr, port):
    assert host.service(f"redis-server@{port}").is_running
    assert host.service(f"redis-server@{port}").is_enabled
    assert host.socket(f"tcp://{addr}:{port}").is_listening
    assert host.socket(f"tcp://{addr}:{port + 10000}").is_listening
    assert not host.socket(f"tcp://0.0.0.0:{port}").is_listening
    assert not host.socket(f"tcp://127.0.0.1:{port}").is_listening
    d = host.file(f"/var/lib/redis/{port}")
    assert (d.user, d.mode) == ("redis", 0o750)


def test_cluster_formed_with_three_masters_and_three_replicas(host, cfg, addr):
    info = cli(host, addr, "sarv-admin", cfg["redis_cluster_admin_password"], "cluster", "info")
    assert info.rc == 0, info.stderr
    assert "cluster_state:ok" in info.stdout
    assert "cluster_known_nodes:6" in info.stdout
    assert "cluster_slots_assigned:16384" in info.stdout
    nodes = cli(host, addr, "sarv-admin", cfg["redis_cluster_admin_password"], "cluster", "nodes").stdout
    roles = re.findall(r"\b(master|slave)\b", nodes)
    assert roles.count("master") == 3
    assert roles.count("slave") == 3


def test_aof_enabled(host, cfg, addr):
    out = cli(
        host, addr, "sarv-admin", cfg["redis_cluster_admin_password"], "config", "get", "appendonly"
    ).stdout
    assert out.split() == ["appendonly", "yes"]


def test_anonymous_access_refused(host, addr):
    out = host.run(f"redis-cli -h {addr} -p 7000 ping")
    assert "PONG" not in out.stdout
    assert "NOAUTH" in out.stdout + out.stderr


def test_gateway_user_limited_to_prefix(host, cfg, addr):
    pw = cfg["redis_cluster_gateway_password"]
    ok = cli(host, addr, "sarv-gateway", pw, "set", "sarv:molecule", "1")
    assert ok.stdout.strip() == "OK", ok.stdout + ok.stderr
    assert cli(host, addr, "sarv-gateway", pw, "get", "sarv:molecule").stdout.strip() == "1"
    # Sarv's store keys carry the Cluster hash tag {sarv:}
    tagged = cli(host, addr, "sarv-gateway", pw, "set", "{sarv:}molecule", "1")
    assert tagged.stdout.strip() == "OK", tagged.stdout + tagged.stderr
    denied = cli(host, addr, "sarv-gateway", pw, "set", "other:key", "1")
    assert "NOPERM" in denied.stdout + denied.stderr
    flush = cli(host, addr, "sarv-gateway", pw, "flushall")
    assert "NOPERM" in flush.stdout + flush.stderr


def test_controlplane_user_can_discover_cluster(host, cfg, addr):
    pw = cfg["redis_cluster_controlplane_password"]
    slots = cli(host, addr, "sarv-controlplane", pw, "cluster", "slots")
    assert slots.rc == 0 and "NOPERM" not in slots.stdout, slots.stdout
    assert cli(host, addr, "sarv-controlplane", pw, "set", "sarv:cp", "x").stdout.strip() == "OK"
    denied = cli(host, addr, "sarv-controlplane", pw, "config", "set", "appendonly", "no")
    assert "NOPERM" in denied.stdout + denied.stderr


def test_wrong_password_refused(host, addr):
    out = cli(host, addr, "sarv-gateway", "not-the-password", "ping")
    assert "PONG" not in out.stdout
