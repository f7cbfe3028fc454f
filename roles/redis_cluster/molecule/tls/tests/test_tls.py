"""sarv.redis_cluster with TLS: TLS-only ports, TLS cluster bus and replication, cluster formed over TLS."""

import shlex

import pytest

PORTS = range(7100, 7103)
TLS = ["--tls", "--cacert", "/etc/redis/tls/ca.crt", "--cert", "/etc/redis/tls/redis.crt", "--key", "/etc/redis/tls/redis.key"]


@pytest.fixture(scope="module")
def addr(host):
    return host.interface.default().addresses[0]


def cli(host, addr, *args, tls=True, port=7100):
    pw = host.ansible.get_variables()["redis_cluster_admin_password"]
    argv = ["redis-cli", "-h", addr, "-p", str(port), "--user", "sarv-admin", "--askpass", *(TLS if tls else []), *args]
    return host.run(f"printf '%s\\n' {shlex.quote(pw)} | {' '.join(shlex.quote(a) for a in argv)}")


def test_tls_files(host):
    assert host.file("/etc/redis/tls").mode == 0o750
    key = host.file("/etc/redis/tls/redis.key")
    assert (key.user, key.group, key.mode) == ("root", "redis", 0o640)


@pytest.mark.parametrize("port", PORTS)
def test_config_is_tls_only(host, port):
    text = host.file(f"/etc/redis/redis-{port}.conf").content_string
    assert "\nport 0\n" in text
    assert f"\ntls-port {port}\n" in text
    assert "\ntls-cluster yes\n" in text
    assert "\ntls-replication yes\n" in text


def test_cluster_formed_over_tls(host, addr):
    info = cli(host, addr, "cluster", "info")
    assert info.rc == 0, info.stderr
    assert "cluster_state:ok" in info.stdout
    assert "cluster_known_nodes:3" in info.stdout


def test_plain_text_is_refused(host, addr):
    out = cli(host, addr, "ping", tls=False)
    assert "PONG" not in out.stdout
