"""Service-node Ansible (Redis Cluster, Prometheus, node exporter, Grafana, Sarv's control plane).

Fast checks render and validate what the roles produce; the Molecule tests run ``molecule test`` (destroy,
create, prepare, converge, idempotence, verify, destroy) in each role directory as a subprocess, against a
Debian 12 systemd container built from the local image ``sarv-testbed:bookworm`` (scripts/testbed-image),
named per run through ``SARV_MOLECULE_INSTANCE`` (.config/molecule/config.yml) so runs never collide.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from fixtures.ansible import TESTBED_IMAGE
from fixtures.ansible import ansible_env as _env
from fixtures.ansible import tail as _tail
from fixtures.ansible import venv_tool as _tool
from fixtures.common import REPO, need, need_binary

SERVICE_ROLES = ["redis_cluster", "prometheus", "node_exporter", "grafana", "sarv_controlplane"]
SERVICE_PLAYBOOKS = ["playbooks/redis.yml", "playbooks/monitoring.yml", "playbooks/controlplane.yml"]


def _run(argv: list[str], *, timeout: int = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=timeout, check=False
    )


# --- fast checks -----------------------------------------------------------------------------------------


def test_service_argument_specs_match_defaults() -> None:
    out = _run([str(REPO / "scripts" / "lint-argument-specs"), *(f"roles/{r}" for r in SERVICE_ROLES)])
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("role", SERVICE_ROLES)
def test_secrets_have_no_default_and_are_no_log(role: str) -> None:
    defaults = yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())
    specs = yaml.safe_load((REPO / "roles" / role / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"]["options"]
    secrets = [k for k in defaults if k.endswith(("_password", "_secret_key"))]
    for key in secrets:
        assert defaults[key] == "", f"{role}: {key} has a default value"
        assert options[key].get("no_log") is True, f"{role}: {key} is not no_log in argument_specs"


@pytest.mark.parametrize("playbook", SERVICE_PLAYBOOKS)
def test_service_playbook_syntax(playbook: str) -> None:
    out = _run(
        [_tool("ansible-playbook"), "--syntax-check", "-i", "inventory.example.ini", playbook],
        ANSIBLE_ROLES_PATH=str(REPO / "roles"),
    )
    assert out.returncode == 0, _tail(out.stdout + out.stderr)


@pytest.mark.parametrize("playbook", SERVICE_PLAYBOOKS)
def test_service_playbooks_run_preflight_first(playbook: str) -> None:
    plays = yaml.safe_load((REPO / playbook).read_text())
    for play in plays:
        roles = play.get("roles") or []
        if roles:
            assert roles[0]["role"] == "preflight", (
                f"{playbook}: play {play['name']!r} must start with preflight"
            )
            assert "always" in roles[0]["tags"]


def _render(tmp_path: Path, role: str, template: str, extra_vars: dict[str, object]) -> str:
    """Render one of a role's templates on this machine against inventory.example.ini's svc-1."""
    dest = tmp_path / "rendered"
    playbook = tmp_path / "render.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Render",
                    "hosts": "svc-1",
                    "gather_facts": False,
                    "vars_files": [
                        str(REPO / "roles" / role / "defaults" / "main.yml"),
                        str(REPO / "roles" / role / "vars" / "main.yml"),
                    ],
                    "tasks": [
                        {
                            "name": "Render the template",
                            "ansible.builtin.template": {
                                "src": str(REPO / "roles" / role / "templates" / template),
                                "dest": str(dest),
                                "mode": "0600",
                            },
                        }
                    ],
                }
            ]
        )
    )
    vars_file = tmp_path / "vars.yml"
    vars_file.write_text(
        yaml.safe_dump(
            {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, **extra_vars}
        )
    )
    out = _run(
        [_tool("ansible-playbook"), "-i", "inventory.example.ini", "-e", f"@{vars_file}", str(playbook)]
    )
    assert out.returncode == 0, _tail(out.stdout + out.stderr)
    return dest.read_text()


# Grafana's documented provisioning format (grafana.com/docs/grafana/latest/administration/provisioning/):
# the keys each file and entry may have. Grafana ignores unknown keys silently, so a typo would only show
# as a data source or folder that never appears; this keeps the role's files to the documented keys.
_GRAFANA_DATASOURCE_FILE = {"apiVersion", "datasources", "deleteDatasources", "prune"}
_GRAFANA_DATASOURCE = {
    "name", "type", "access", "orgId", "uid", "url", "user", "database", "basicAuth", "basicAuthUser",
    "withCredentials", "isDefault", "jsonData", "secureJsonData", "version", "editable",
}  # fmt: skip
_GRAFANA_PROMETHEUS_JSON_DATA = {
    "httpMethod", "manageAlerts", "prometheusType", "prometheusVersion", "cacheLevel", "incrementalQuerying",
    "incrementalQueryOverlapWindow", "disableRecordingRules", "defaultEditor", "disableMetricsLookup",
    "exemplarTraceIdDestinations", "timeInterval", "queryTimeout", "customQueryParameters", "tlsAuth",
    "tlsAuthWithCACert", "tlsSkipVerify", "oauthPassThru", "keepCookies",
}  # fmt: skip
_GRAFANA_PROVIDER_FILE = {"apiVersion", "providers"}
_GRAFANA_PROVIDER = {
    "name", "orgId", "folder", "folderUid", "type", "disableDeletion", "updateIntervalSeconds",
    "allowUiUpdates", "options",
}  # fmt: skip
_GRAFANA_FILE_PROVIDER_OPTIONS = {"path", "foldersFromFilesStructure"}


def test_grafana_datasource_provisioning_follows_grafanas_format(tmp_path: Path) -> None:
    text = _render(
        tmp_path,
        "grafana",
        "provisioning.yml.j2",
        {
            "_grafana_document": "{{ _grafana_datasources }}",
            "grafana_prometheus_url": "http://10.20.0.101:9090",
        },
    )
    doc = yaml.safe_load(text)
    assert set(doc) <= _GRAFANA_DATASOURCE_FILE and doc["apiVersion"] == 1
    (source,) = doc["datasources"]
    assert set(source) <= _GRAFANA_DATASOURCE, set(source) - _GRAFANA_DATASOURCE
    assert source["type"] == "prometheus" and source["access"] in {"proxy", "direct"}
    assert source["url"] == "http://10.20.0.101:9090"
    assert isinstance(source["isDefault"], bool) and isinstance(source["editable"], bool)
    assert set(source["jsonData"]) <= _GRAFANA_PROMETHEUS_JSON_DATA, set(source["jsonData"])
    assert re.fullmatch(r"\d+[smh]", source["jsonData"]["timeInterval"])
    # The dashboards pick it through their $datasource variable, which lists data sources of this type.
    for board in sorted((REPO / "dashboards").glob("sarv-*.json")):
        variables = json.loads(board.read_text())["templating"]["list"]
        assert {"type": "datasource", "query": source["type"]}.items() <= variables[0].items(), board.name


def test_grafana_dashboard_provider_follows_grafanas_format(tmp_path: Path) -> None:
    text = _render(
        tmp_path,
        "grafana",
        "provisioning.yml.j2",
        {"_grafana_document": "{{ _grafana_dashboard_providers }}"},
    )
    doc = yaml.safe_load(text)
    assert set(doc) <= _GRAFANA_PROVIDER_FILE and doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert set(provider) <= _GRAFANA_PROVIDER, set(provider) - _GRAFANA_PROVIDER
    assert provider["type"] == "file" and isinstance(provider["orgId"], int)
    assert isinstance(provider["updateIntervalSeconds"], int) and provider["updateIntervalSeconds"] >= 10
    assert isinstance(provider["disableDeletion"], bool) and isinstance(provider["allowUiUpdates"], bool)
    assert set(provider["options"]) <= _GRAFANA_FILE_PROVIDER_OPTIONS
    assert provider["options"]["path"].startswith("/"), "the file provider needs an absolute directory"


@pytest.mark.prometheus
def test_prometheus_config_for_the_example_fleet_passes_promtool(tmp_path: Path) -> None:
    promtool = need_binary("promtool")
    text = _render(
        tmp_path,
        "prometheus",
        "prometheus.yml.j2",
        # no gathered facts: every target falls back to its host's ansible_host
        {"prometheus_web_listen_address": "10.20.0.101:9090"},
    )
    (tmp_path / "prometheus.yml").write_text(text)
    check = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    jobs = {j["job_name"]: j for j in yaml.safe_load(text)["scrape_configs"]}
    # every host of the example inventory gets a node target; GPU nodes a DCGM target
    node_targets = [sc["labels"]["instance"] for sc in jobs["node"]["static_configs"]]
    # node exporter and DCGM series carry the host's inventory name as `node`, like replica targets
    for job in ("node", "dcgm"):
        assert all(sc["labels"]["node"] == sc["labels"]["instance"] for sc in jobs[job]["static_configs"])
    assert sorted(node_targets) == sorted(
        ["gpu-a1", "gpu-a2", "gpu-b1", "gpu-b2", "gpu-c1", "svc-1", "svc-2", "svc-3"]
    )
    dcgm = [sc["targets"][0] for sc in jobs["dcgm"]["static_configs"]]
    assert sorted(dcgm) == [
        "10.20.0.11:9400",
        "10.20.0.12:9400",
        "10.20.0.21:9400",
        "10.20.0.22:9400",
        "10.20.0.31:9400",
    ]
    # the gateway's metrics listener, not its API port; no token, no authorization block
    assert jobs["sarv-gateway"]["static_configs"][0]["targets"] == ["10.20.0.101:9107"]
    assert "authorization" not in jobs["sarv-gateway"]


@pytest.mark.prometheus
def test_prometheus_presents_the_gateway_metrics_token_from_a_file(tmp_path: Path) -> None:
    token = "gw-metrics-" + "t" * 16
    text = _render(
        tmp_path,
        "prometheus",
        "prometheus.yml.j2",
        {"prometheus_web_listen_address": "10.20.0.101:9090", "prometheus_sarv_gateway_metrics_token": token},
    )
    assert token not in text
    jobs = {j["job_name"]: j for j in yaml.safe_load(text)["scrape_configs"]}
    assert jobs["sarv-gateway"]["authorization"] == {
        "type": "Bearer",
        "credentials_file": "/etc/prometheus/sarv-gateway-metrics.token",
    }
    assert "authorization" not in jobs["node"]


def test_controlplane_config_names_the_gateway_tls_files_and_metrics_listener(tmp_path: Path) -> None:
    from controlplane.settings import Settings

    text = _render(
        tmp_path,
        "sarv_controlplane",
        "config.yaml.j2",
        {
            "sarv_controlplane_gateway_tls_cert_file": "files/gw.crt",
            "sarv_controlplane_gateway_tls_key_file": "files/gw.key",
            "sarv_controlplane_gateway_tls_client_ca_file": "files/ca.crt",
            "sarv_controlplane_gateway_metrics_host": "10.20.0.101",
            "sarv_controlplane_gateway_metrics_token": "m" * 20,
        },
    )
    data = yaml.safe_load(text)
    assert data["gateway_tls_cert"] == "/etc/sarv/tls/gateway.crt"
    assert data["gateway_tls_key"] == "/etc/sarv/tls/gateway.key"
    assert data["gateway_tls_client_ca"] == "/etc/sarv/tls/gateway-client-ca.crt"
    assert (data["gateway_metrics_host"], data["gateway_metrics_port"]) == ("10.20.0.101", 9107)
    assert data["gateway_metrics_token_file"] == "/etc/sarv/gateway-metrics.token"
    assert "m" * 20 not in text
    Settings.model_validate(data)  # what the role's validate: step runs
    plain = yaml.safe_load(_render(tmp_path, "sarv_controlplane", "config.yaml.j2", {}))
    assert "gateway_tls_cert" not in plain and "gateway_metrics_token_file" not in plain
    unit = _render(tmp_path, "sarv_controlplane", "sarv-gateway.service.j2", {})
    assert "ExecReload=/bin/kill -HUP $MAINPID" in unit.splitlines()


def test_controlplane_speaks_tls_to_a_tls_only_redis_cluster_with_its_ca(tmp_path: Path) -> None:
    """With the redis group running TLS-only, the built state URL is rediss+cluster:// and the control plane
    trusts the cluster's own CA unless it names another; a plain cluster keeps redis+cluster:// and no CA."""
    tls = {"redis_cluster_tls_enabled": True, "redis_cluster_tls_ca_file": "files/redis-ca.crt"}
    data = yaml.safe_load(_render(tmp_path, "sarv_controlplane", "config.yaml.j2", tls))
    assert data["state_url"].startswith("rediss+cluster://10.20.0."), data["state_url"]
    assert data["redis_tls_ca"] == "/etc/sarv/tls/redis-ca.crt"
    # The CA file copied to /etc/sarv/tls/redis-ca.crt (an absolute template path: the role's variable alone).
    source = tmp_path / "ca-source.j2"
    source.write_text("{{ _sarv_controlplane_redis_tls_ca_file }}")
    assert _render(tmp_path, "sarv_controlplane", str(source), tls).strip() == "files/redis-ca.crt"
    own = {**tls, "sarv_controlplane_redis_tls_ca_file": "files/other-ca.crt"}
    assert _render(tmp_path, "sarv_controlplane", str(source), own).strip() == "files/other-ca.crt"
    plain = yaml.safe_load(_render(tmp_path, "sarv_controlplane", "config.yaml.j2", {}))
    assert plain["state_url"].startswith("redis+cluster://10.20.0."), plain["state_url"]
    assert "redis_tls_ca" not in plain


def test_redis_config_hashes_user_passwords(tmp_path: Path) -> None:
    pw = {
        "redis_cluster_admin_password": "admin-password-0123456789",
        "redis_cluster_replication_password": "repl-password-0123456789",
        "redis_cluster_controlplane_password": "cp-password-0123456789",
        "redis_cluster_gateway_password": "gw-password-0123456789",
    }
    text = _render(
        tmp_path,
        "redis_cluster",
        "redis-instance.conf.j2",
        {**pw, "__redis_cluster_port": 6380, "redis_cluster_bind_address": "10.20.0.101"},
    )
    assert "bind 10.20.0.101\n" in text
    assert "port 6380\n" in text
    assert "user default reset\n" in text
    for key in (
        "redis_cluster_admin_password",
        "redis_cluster_controlplane_password",
        "redis_cluster_gateway_password",
    ):
        assert pw[key] not in text
    # only the replication password is stored in clear (masterauth), as Redis requires
    assert f"masterauth {pw['redis_cluster_replication_password']}\n" in text


# --- Molecule --------------------------------------------------------------------------------------------


def _need_docker() -> None:
    docker = need_binary("docker")
    info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=60, check=False)
    need(info.returncode == 0, "the Docker daemon is not running (scripts/test starts it)")
    image = subprocess.run(
        [docker, "image", "inspect", TESTBED_IMAGE], capture_output=True, text=True, timeout=60, check=False
    )
    need(image.returncode == 0, f"{TESTBED_IMAGE} is missing (scripts/testbed-image builds it)")


def molecule_test(cwd: Path, instance: str, *args: str, timeout: int = 1500) -> None:
    """``molecule test [args]`` in ``cwd``; on failure remove what the run left and show the log's tail."""
    _need_docker()
    out = subprocess.run(
        [_tool("molecule"), "test", *args],
        cwd=cwd,
        env=_env(SARV_MOLECULE_INSTANCE=instance),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    if out.returncode != 0:
        docker = shutil.which("docker")
        if docker:  # `molecule test` destroys on failure; make sure nothing of this run is left behind
            names = subprocess.run(
                [docker, "ps", "-aq", "--filter", f"name=^{instance}"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            ).stdout.split()
            if names:
                subprocess.run([docker, "rm", "-f", *names], capture_output=True, timeout=120, check=False)
    assert out.returncode == 0, f"molecule test failed in {cwd.relative_to(REPO)}:\n{_tail(out.stdout, 150)}"


@pytest.mark.molecule
@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("role", SERVICE_ROLES)
def test_molecule_service_role(role: str) -> None:
    molecule_test(REPO / "roles" / role, f"sarv-{role.replace('_', '-')}-{uuid.uuid4().hex[:8]}")
