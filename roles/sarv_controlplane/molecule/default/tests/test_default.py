"""Real state after converging sarv.sarv_controlplane: venv, config, secrets, units, running services."""

import json

import pytest
import yaml

VENV = "/opt/sarv/venv"


@pytest.fixture(scope="module")
def addr(host):
    return host.interface.default().addresses[0]


def test_user_and_home(host):
    u = host.user("sarv")
    assert u.shell == "/usr/sbin/nologin"
    d = host.file("/var/lib/sarv")
    assert (d.user, d.group, d.mode) == ("sarv", "sarv", 0o750)


def test_venv_llmctl_version(host):
    out = host.check_output(f"{VENV}/bin/llmctl --version")
    assert out.startswith("llmctl (sarv) ")


def test_base_package_only(host):
    # no extras: the CPU vLLM engine is not installed on a service node
    assert host.run(f"{VENV}/bin/python -c 'import vllm'").rc != 0


def test_config_file_matches_settings(host, addr):
    f = host.file("/etc/sarv/config.yaml")
    assert (f.user, f.group, f.mode) == ("root", "sarv", 0o640)
    assert "Ansible managed" in f.content_string
    cfg = yaml.safe_load(f.content_string)
    assert cfg["gateway_host"] == addr
    assert cfg["gateway_port"] == 8088
    assert cfg["inventory"] == "/etc/sarv/inventory.yml"
    assert "redis_password" not in cfg
    # the installed Settings model accepts every key (extra="forbid")
    check = host.run(
        f"SARV_CONFIG=/etc/sarv/config.yaml {VENV}/bin/python -c "
        "'from controlplane.settings import load_settings; print(load_settings().gateway_port)'"
    )
    assert check.rc == 0, check.stderr
    assert check.stdout.strip() == "8088"


@pytest.mark.parametrize("name", ["sarv-gateway", "sarv-controller"])
def test_secret_env_files_root_only(host, name):
    f = host.file(f"/etc/sarv/{name}.env")
    assert (f.user, f.group, f.mode) == ("root", "root", 0o600)


@pytest.mark.parametrize("name", ["sarv-gateway", "sarv-controller"])
def test_units_installed_enabled_running(host, name):
    unit = host.file(f"/etc/systemd/system/{name}.service")
    assert unit.mode == 0o644
    assert "Ansible managed" in unit.content_string
    assert "User=sarv" in unit.content_string
    assert f"EnvironmentFile=/etc/sarv/{name}.env" in unit.content_string
    svc = host.service(name)
    assert svc.is_enabled
    assert svc.is_running


def test_gateway_command_line_has_no_secret(host, addr):
    unit = host.file("/etc/systemd/system/sarv-gateway.service").content_string
    assert f"gateway --host {addr} --port 8088" in unit
    assert "PASSWORD" not in unit.upper().replace("ENVIRONMENTFILE", "")


def test_gateway_answers(host, addr):
    assert host.socket(f"tcp://{addr}:8088").is_listening
    assert host.run(f"curl -fsS http://{addr}:8088/health").rc == 0
    # the API itself demands a key: no anonymous access through the installed gateway
    code = host.check_output(f"curl -s -o /dev/null -w '%{{http_code}}' http://{addr}:8088/v1/models")
    assert code == "401"


def test_gateway_metrics_are_on_their_own_listener(host, addr):
    assert host.socket(f"tcp://{addr}:9107").is_listening
    assert "sarv_gateway_replicas" in host.check_output(f"curl -fsS http://{addr}:9107/metrics")
    code = host.check_output(f"curl -s -o /dev/null -w '%{{http_code}}' http://{addr}:8088/metrics")
    assert code == "404"


def test_controller_metrics(host, addr):
    assert host.run(f"curl -fsS http://{addr}:9106/metrics").rc == 0


def test_llmctl_inventory_lists_the_declared_gpus(host):
    out = host.check_output(
        f"SARV_CONFIG=/etc/sarv/config.yaml {VENV}/bin/llmctl inventory -i /etc/sarv/inventory.yml --output json"
    )
    doc = json.loads(out)
    text = json.dumps(doc)
    assert "A100-SXM4-80GB" in text
    host_name = host.ansible.get_variables()["inventory_hostname"]
    assert host_name in text
