"""What sarv.grafana writes, read back from the host (the package and the service are not installable here)."""

import json

import pytest
import yaml


def test_grafana_ini_holds_secrets_readable_by_grafana_only(host):
    f = host.file("/etc/grafana/grafana.ini")
    assert (f.user, f.group, f.mode) == ("root", "grafana", 0o640)
    text = f.content_string
    assert "Ansible managed" in text
    addr = host.interface.default().addresses[0]
    assert f"http_addr = {addr}" in text
    assert "admin_password = molecule-grafana-admin" in text
    assert "reporting_enabled = false" in text
    assert "allow_sign_up = false" in text


@pytest.mark.parametrize(
    "path",
    ["/etc/grafana/provisioning/datasources/sarv.yml", "/etc/grafana/provisioning/dashboards/sarv.yml"],
)
def test_provisioning_files_modes(host, path):
    f = host.file(path)
    assert (f.user, f.group, f.mode) == ("root", "grafana", 0o640)
    assert f.content_string.startswith("#")
    assert "Ansible managed" in f.content_string


def test_datasource_provisioning(host):
    doc = yaml.safe_load(host.file("/etc/grafana/provisioning/datasources/sarv.yml").content_string)
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    addr = host.interface.default().addresses[0]
    assert ds["type"] == "prometheus"
    assert ds["uid"] == "sarv-prometheus"
    assert ds["url"] == f"http://{addr}:9090"
    assert ds["isDefault"] is True
    assert ds["editable"] is False


def test_dashboard_file_provider(host):
    doc = yaml.safe_load(host.file("/etc/grafana/provisioning/dashboards/sarv.yml").content_string)
    (p,) = doc["providers"]
    assert p["type"] == "file"
    assert p["folder"] == "Sarv"
    assert p["allowUiUpdates"] is False
    assert p["options"]["path"] == "/var/lib/grafana/dashboards/sarv"
    assert host.file(p["options"]["path"]).is_directory


def test_dashboards_copied(host):
    f = host.file("/var/lib/grafana/dashboards/sarv/sarv-molecule.json")
    assert (f.user, f.group, f.mode) == ("root", "grafana", 0o644)
    assert json.loads(f.content_string)["uid"] == "sarv-molecule"
