"""nvidia_container_toolkit against the fake NVIDIA mirror: pinned packages and the daemon-reload guard."""

import pytest

SOURCE = "/etc/apt/sources.list.d/nvidia-container-toolkit.list"


def test_repository_entry(host):
    f = host.file(SOURCE)
    assert f.mode == 0o644
    entries = [line for line in f.content_string.splitlines() if line.startswith("deb ")]
    assert entries == [
        "deb [signed-by=/etc/apt/keyrings/nvidia-container-toolkit.asc] "
        "http://127.0.0.1:8089/libnvidia-container/stable/deb/$(ARCH) /"
    ]


@pytest.mark.parametrize(
    "pkg",
    [
        "nvidia-container-toolkit",
        "nvidia-container-toolkit-base",
        "libnvidia-container-tools",
        "libnvidia-container1",
    ],
)
def test_pinned_packages(host, pkg):
    p = host.package(pkg)
    assert p.is_installed
    # 1.18.0-1 is also in the mirror: the pin, not "newest", decided.
    assert p.version == "1.17.8-1"


def test_dev_char_udev_rule(host):
    rule = host.file("/etc/udev/rules.d/71-nvidia-dev-char.rules")
    assert rule.mode == 0o644
    assert (
        'ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", '
        'RUN+="/usr/bin/nvidia-ctk system create-dev-char-symlinks --create-all"'
    ) in rule.content_string


def test_dev_char_unit_enabled_and_valid(host):
    unit = host.file("/etc/systemd/system/nvidia-dev-char-symlinks.service")
    assert unit.mode == 0o644
    assert "Before=docker.service" in unit.content_string
    assert host.service("nvidia-dev-char-symlinks").is_enabled
    check = host.run("systemd-analyze verify /etc/systemd/system/nvidia-dev-char-symlinks.service")
    assert check.rc == 0, check.stderr
