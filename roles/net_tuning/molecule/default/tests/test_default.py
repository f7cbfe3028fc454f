"""Network sysctls: persisted for all keys, live for the ones a container's network namespace can hold."""

import pytest

PERSISTED = {
    "net.core.default_qdisc": "fq",
    "net.ipv4.tcp_congestion_control": "bbr",
    "net.ipv4.tcp_ecn": "1",
    "net.core.rmem_max": "268435456",
    "net.core.wmem_max": "268435456",
    "net.ipv4.tcp_rmem": "4096 87380 268435456",
    "net.ipv4.tcp_wmem": "4096 65536 268435456",
    "net.core.somaxconn": "65535",
    "net.ipv4.tcp_max_syn_backlog": "65535",
    "net.core.netdev_max_backlog": "250000",
}
# Per-network-namespace keys, pre-set on the container (molecule.yml) and checked live.
LIVE = [
    "net.ipv4.tcp_congestion_control",
    "net.ipv4.tcp_ecn",
    "net.ipv4.tcp_rmem",
    "net.ipv4.tcp_wmem",
    "net.core.somaxconn",
    "net.ipv4.tcp_max_syn_backlog",
]


def _parse(content):
    out = {}
    for line in content.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        out[key.strip()] = " ".join(value.split())
    return out


def test_sysctl_file_persists_every_key(host):
    f = host.file("/etc/sysctl.d/60-sarv-net.conf")
    assert f.user == "root"
    assert f.mode == 0o644
    assert "Ansible managed" in f.content_string
    assert _parse(f.content_string) == PERSISTED


@pytest.mark.parametrize("key", LIVE)
def test_namespaced_sysctl_live(host, key):
    assert " ".join(host.check_output(f"sysctl -n {key}").split()) == PERSISTED[key]


def test_bbr_module_loaded_at_boot(host):
    f = host.file("/etc/modules-load.d/60-sarv-net.conf")
    assert f.mode == 0o644
    assert "tcp_bbr" in f.content_string.split()
    assert "bbr" in host.file("/proc/sys/net/ipv4/tcp_available_congestion_control").content_string.split()
