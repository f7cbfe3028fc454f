"""Real state after converging sarv.prometheus: package, checked config, flags, service, API and targets."""

import json

import pytest


@pytest.fixture(scope="module")
def addr(host):
    return host.interface.default().addresses[0]


def api(host, addr, path):
    return json.loads(host.check_output(f"curl -fsS http://{addr}:9090{path}"))


def test_package(host):
    assert host.package("prometheus").is_installed
    # installed without recommends: no stray node exporter from this role
    assert not host.package("prometheus-node-exporter").is_installed


def test_config_file(host):
    f = host.file("/etc/prometheus/prometheus.yml")
    assert (f.user, f.group, f.mode) == ("root", "prometheus", 0o640)
    assert "Ansible managed" in f.content_string
    assert host.run("promtool check config /etc/prometheus/prometheus.yml").rc == 0


def test_flags(host):
    f = host.file("/etc/default/prometheus")
    assert (f.user, f.mode) == ("root", 0o644)
    assert "--storage.tsdb.retention.time=2d" in f.content_string


def test_directories(host):
    for path in ("/etc/prometheus/file_sd", "/etc/prometheus/rules"):
        d = host.file(path)
        assert d.is_directory
        assert (d.user, d.group, d.mode) == ("root", "prometheus", 0o755)


def test_service_on_private_address(host, addr):
    svc = host.service("prometheus")
    assert svc.is_running and svc.is_enabled
    assert host.socket(f"tcp://{addr}:9090").is_listening
    assert not host.socket("tcp://0.0.0.0:9090").is_listening


def test_ready_and_retention(host, addr):
    assert "Ready" in host.check_output(f"curl -fsS http://{addr}:9090/-/ready")
    flags = api(host, addr, "/api/v1/status/flags")["data"]
    assert flags["storage.tsdb.retention.time"] == "2d"


def test_targets(host, addr):
    targets = api(host, addr, "/api/v1/targets")["data"]["activeTargets"]
    jobs = {t["labels"]["job"]: t for t in targets}
    assert set(jobs) >= {"prometheus", "node", "molecule-extra"}
    assert "sarv-gateway" not in jobs  # the scenario set its group to ""
    assert "sarv-controller" not in jobs
    assert jobs["node"]["scrapeUrl"] == f"http://{addr}:9100/metrics"


def test_scrapes_itself(host, addr):
    # `up` for the self-scrape becomes 1 after the first scrape (15 s interval): poll, bounded.
    out = host.run(
        "for i in $(seq 1 30); do "
        f"curl -fsS 'http://{addr}:9090/api/v1/query?query=up%7Bjob%3D%22prometheus%22%7D' | grep -q '\"1\"]' && exit 0; "
        "sleep 2; done; exit 1"
    )
    assert out.rc == 0
