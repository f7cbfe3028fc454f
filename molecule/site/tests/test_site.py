"""The site after site.yml: a TLS-only Redis Cluster formed (clients, replication and cluster bus over TLS),
Prometheus scraping, the control plane up and using the cluster over TLS, fake GPUs listed."""

import json
import os
import shlex
from pathlib import Path

import pytest

RUN = os.environ.get("SARV_MOLECULE_INSTANCE", "sarv-site")
SVC = f"{RUN}-svc"
GPUS = [f"{RUN}-gpu1", f"{RUN}-gpu2"]
VENV = "/opt/sarv/venv"
PORTS = range(6379, 6385)  # six instances on the service node
TLS = ["--tls", "--cacert", "/etc/redis/tls/ca.crt"]

testinfra_hosts = [f"ansible://{SVC}"]


@pytest.fixture(scope="module")
def svc(host):
    return host


@pytest.fixture(scope="module")
def cfg(host):
    return host.ansible.get_variables()


@pytest.fixture(scope="module")
def addr(host):
    return host.interface.default().addresses[0]


def _redis(host, addr, password, *args, user="sarv-admin", port=6379, tls=True):
    argv = ["redis-cli", "-c", "-h", addr, "-p", str(port), "--user", user, "--askpass"]
    argv += [*(TLS if tls else []), *args]
    return host.run(f"printf '%s\\n' {shlex.quote(password)} | {' '.join(shlex.quote(a) for a in argv)}")


def test_redis_tls_files(svc):
    assert svc.file("/etc/redis/tls").mode == 0o750
    key = svc.file("/etc/redis/tls/redis.key")
    assert (key.user, key.group, key.mode) == ("root", "redis", 0o640)


@pytest.mark.parametrize("port", PORTS)
def test_redis_is_tls_only(svc, port):
    text = svc.file(f"/etc/redis/redis-{port}.conf").content_string
    assert "\nport 0\n" in text
    assert f"\ntls-port {port}\n" in text
    assert "\ntls-cluster yes\n" in text
    assert "\ntls-replication yes\n" in text


def test_redis_refuses_plain_text(svc, cfg, addr):
    out = _redis(svc, addr, cfg["redis_cluster_admin_password"], "ping", tls=False)
    assert "PONG" not in out.stdout


def test_redis_replicas_follow_their_masters_over_tls(svc, cfg, addr):
    password = cfg["redis_cluster_admin_password"]
    links = [_redis(svc, addr, password, "info", "replication", port=p).stdout for p in PORTS]
    assert sum("role:slave" in r for r in links) == 3, links
    assert sum("master_link_status:up" in r for r in links) == 3, links


def _get_json(host, url):
    return json.loads(host.check_output(f"curl -fsS {shlex.quote(url)}"))


def test_redis_cluster_formed_and_answers(svc, cfg, addr):
    info = _redis(svc, addr, cfg["redis_cluster_admin_password"], "cluster", "info")
    assert "cluster_state:ok" in info.stdout, info.stdout + info.stderr
    assert "cluster_known_nodes:6" in info.stdout
    assert "cluster_size:3" in info.stdout
    gw = _redis(
        svc,
        addr,
        cfg["redis_cluster_gateway_password"],
        "set",
        "{sarv:}site-check",
        "ok",
        user="sarv-gateway",
    )
    assert gw.stdout.strip() == "OK", gw.stdout + gw.stderr


def test_prometheus_scrapes_every_node_exporter_and_the_control_plane(svc, addr):
    # First scrapes happen within one interval (15 s) of the last reload: poll, bounded (90 s).
    script = (
        "for i in $(seq 1 45); do "
        f"curl -fsS 'http://{addr}:9090/api/v1/targets?state=active' > /tmp/targets.json && "
        'python3 -c \'import json,sys; t=json.load(open("/tmp/targets.json"))["data"]["activeTargets"]; '
        'jobs=("node","sarv-gateway","sarv-controller","prometheus"); '
        'want=[x for x in t if x["labels"]["job"] in jobs]; '
        'sys.exit(0 if len(want) == 6 and all(x["health"] == "up" for x in want) else 1)\' && exit 0; '
        "sleep 2; done; exit 1"
    )
    res = svc.run(script)
    targets = _get_json(svc, f"http://{addr}:9090/api/v1/targets?state=active")["data"]["activeTargets"]
    summary = sorted(
        (t["labels"]["job"], t["labels"].get("instance"), t["health"], t["lastError"]) for t in targets
    )
    assert res.rc == 0, summary
    nodes = {t["labels"]["instance"] for t in targets if t["labels"]["job"] == "node"}
    assert nodes == {SVC, *GPUS}


def test_prometheus_has_node_samples_from_the_gpu_nodes(svc, addr):
    q = "count(node_uname_info)"
    out = _get_json(svc, f"http://{addr}:9090/api/v1/query?query={q.replace('(', '%28').replace(')', '%29')}")
    assert int(out["data"]["result"][0]["value"][1]) == 3


@pytest.mark.parametrize("unit", ["sarv-gateway", "sarv-controller"])
def test_control_plane_services_running(svc, unit):
    s = svc.service(unit)
    assert s.is_enabled and s.is_running


def test_control_plane_uses_the_redis_cluster(svc):
    cfg = json.loads(
        svc.check_output(
            f"SARV_CONFIG=/etc/sarv/config.yaml {VENV}/bin/python -c "
            "'import json; from controlplane.settings import load_settings; "
            'print(json.dumps(load_settings().model_dump(mode="json")))\''
        )
    )
    # TLS, built from the redis group's TLS setting, trusting the cluster's CA and checking the address the
    # certificate names: the lease below is taken over that connection.
    assert cfg["state_url"].startswith("rediss+cluster://")
    assert cfg["redis_tls_ca"] == "/etc/sarv/tls/redis-ca.crt"
    ca = svc.file("/etc/redis/tls/ca.crt").content_string
    assert svc.file("/etc/sarv/tls/redis-ca.crt").content_string == ca
    assert cfg["redis_password"] is None  # the secret is not in config.yaml
    journal = svc.check_output("journalctl -u sarv-controller --no-pager -o cat")
    assert "holds the lease" in journal, journal[-2000:]


def test_gateway_health(svc, addr):
    assert _get_json(svc, f"http://{addr}:8080/health") == {"status": "ok"}


def test_llmctl_inventory_lists_the_fake_gpus(svc):
    out = svc.check_output(
        f"SARV_CONFIG=/etc/sarv/config.yaml {VENV}/bin/llmctl inventory"
        " -i /etc/sarv/inventory.yml --output json"
    )
    fleet = json.loads(out)
    nodes = {n["name"]: n for n in fleet["nodes"]}
    assert set(nodes) == set(GPUS)
    for n in nodes.values():
        assert [g["model"] for g in n["gpus"]] == ["A100-SXM4-80GB"] * 2
        assert all(g["memory_total_mib"] == 81920 for g in n["gpus"])


def test_declared_gpus_match_what_the_fake_nvidia_smi_reports(svc):
    """The GPU nodes' nvidia-smi, parsed by Sarv's discovery parser, agrees with the declared inventory."""
    import testinfra

    from controlplane.fleet.nvidia_smi import gpus_from_nvidia_smi, query_argv, topology_argv

    inventory = os.environ["MOLECULE_INVENTORY_FILE"]
    for name in GPUS:
        gpu_host = testinfra.get_host(f"ansible://{name}", ansible_inventory=inventory)
        query = gpu_host.check_output(" ".join(shlex.quote(a) for a in query_argv()))
        topo = gpu_host.check_output(" ".join(shlex.quote(a) for a in topology_argv()))
        gpus = gpus_from_nvidia_smi(query, topo, host=name)
        assert [(g.model, g.memory_total_mib) for g in gpus] == [("A100-SXM4-80GB", 81920)] * 2


def test_grafana_provisioned_with_the_repository_dashboards(svc):
    repo = Path(__file__).resolve().parents[3] / "dashboards"
    expected = sorted(p.name for p in repo.glob("*.json"))
    assert expected, f"no dashboards in {repo}"
    listed = svc.check_output("ls /var/lib/grafana/dashboards/sarv").split()
    assert sorted(listed) == expected
    for name in expected:
        assert json.loads(svc.file(f"/var/lib/grafana/dashboards/sarv/{name}").content_string)["uid"]
    assert svc.file("/etc/grafana/provisioning/datasources/sarv.yml").mode == 0o640
