"""Docker Engine from Debian's archive, running, with Sarv's daemon.json applied."""

import json


def _info(host, fmt):
    return host.check_output(f"docker info --format '{fmt}'")


def test_packages(host):
    assert host.package("docker.io").is_installed
    assert host.package("apparmor").is_installed


def test_daemon_json(host):
    f = host.file("/etc/docker/daemon.json")
    assert f.user == "root"
    assert f.mode == 0o644
    conf = json.loads(f.content_string)
    assert conf["no-new-privileges"] is True
    assert conf["live-restore"] is True
    assert conf["log-driver"] == "json-file"
    assert conf["log-opts"] == {"max-size": "50m", "max-file": "5"}
    assert conf["runtimes"] == {"nvidia": {"path": "nvidia-container-runtime", "runtimeArgs": []}}
    assert "default-runtime" not in conf
    assert "selinux-enabled" not in conf  # Debian: AppArmor, not SELinux


def test_docker_running(host):
    svc = host.service("docker")
    assert svc.is_enabled
    assert svc.is_running
    sock = host.file("/var/run/docker.sock")
    assert sock.is_socket
    assert sock.group == "docker"
    assert sock.mode == 0o660


def test_daemon_applied_the_config(host):
    assert _info(host, "{{.LiveRestoreEnabled}}") == "true"
    assert _info(host, "{{.CgroupDriver}}") == "systemd"
    assert _info(host, "{{.LoggingDriver}}") == "json-file"
    assert "nvidia" in json.loads(_info(host, "{{json .Runtimes}}"))
    assert json.loads(_info(host, "{{json .RegistryConfig.Mirrors}}")) == ["https://registry.example.internal/"]
