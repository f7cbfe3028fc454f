"""Real state after the common role on a Debian 12 container host."""

import pytest


@pytest.mark.parametrize("pkg", ["chrony", "curl", "gnupg", "jq", "pciutils", "ca-certificates"])
def test_base_packages_installed(host, pkg):
    assert host.package(pkg).is_installed


def test_apt_sources_point_at_the_mirror(host):
    sources = host.file("/etc/apt/sources.list")
    assert sources.mode == 0o644
    assert sources.user == "root"
    assert "Ansible managed" in sources.content_string
    assert "deb http://deb.debian.org/debian bookworm main" in sources.content_string
    assert "deb http://deb.debian.org/debian bookworm-updates main" in sources.content_string
    # apt really uses it: the policy lists the mirror for an installed package's origin
    policy = host.check_output("apt-cache policy chrony")
    assert "http://deb.debian.org/debian bookworm" in policy


def test_pip_and_mirror_env(host):
    pip = host.file("/etc/pip.conf")
    assert pip.mode == 0o644
    assert "index-url = https://pypi.example.internal/simple" in pip.content_string
    env = host.file("/etc/sarv/mirrors.env")
    assert env.mode == 0o644
    assert "SARV_REGISTRY_MIRROR=https://registry.example.internal" in env.content_string
    assert "SARV_MODEL_STORE_URL=https://models.example.internal" in env.content_string


def test_chrony_running_with_configured_source(host):
    conf = host.file("/etc/chrony/chrony.conf")
    assert conf.mode == 0o644
    assert "server 127.0.0.1 iburst" in conf.content_string
    assert "pool " not in conf.content_string
    svc = host.service("chrony")
    assert svc.is_enabled
    assert svc.is_running
    sources = host.check_output("chronyc -n sources")
    assert "127.0.0.1" in sources


def test_limits(host):
    limits = host.file("/etc/security/limits.d/90-sarv.conf")
    assert limits.mode == 0o644
    assert "*    hard nofile  1048576" in limits.content_string
    assert "*    hard memlock unlimited" in limits.content_string


def test_journald_applied(host):
    dropin = host.file("/etc/systemd/journald.conf.d/90-sarv.conf")
    assert dropin.mode == 0o644
    assert "SystemMaxUse=512M" in dropin.content_string
    assert host.service("systemd-journald").is_running
    # journald was restarted after the drop-in was written, so it created persistent storage
    assert host.file("/var/log/journal").is_directory
