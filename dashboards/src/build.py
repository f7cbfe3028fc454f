"""Sarv's Grafana dashboards as code: run ``python dashboards/src/build.py`` to regenerate dashboards/*.json.

Plain dicts rather than grafanalib: the JSON model is small, and one file with no extra dependency is
easier to review than a DSL. Every panel queries the ``$datasource`` template variable and every
``rate()`` uses ``$__rate_interval`` (the dashboard-linter rules, checked by tests/observability).
Never edit the rendered JSON by hand; CI regenerates it and fails on any difference.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Panel = dict[str, Any]
Dashboard = dict[str, Any]

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SCHEMA_VERSION = 39
WIDTH = 24


def rate(metric: str, selector: str = "") -> str:
    """``rate()`` over Grafana's ``$__rate_interval`` (at least four scrape intervals, never too short)."""
    sel = f"{{{selector}}}" if selector else ""
    return f"rate({metric}{sel}[$__rate_interval])"


def sum_rate(by: str, metric: str, selector: str = "") -> str:
    return f"sum by ({by}) ({rate(metric, selector)})"


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}


def timeseries(
    title: str,
    queries: list[tuple[str, str]],
    unit: str,
    *,
    description: str = "",
    stack: bool = False,
    width: int = 12,
    height: int = 8,
    minimum: float | None = 0,
    maximum: float | None = None,
) -> Panel:
    """A time series panel; ``queries`` are ``(expr, legendFormat)`` pairs."""
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {"stacking": {"mode": "normal" if stack else "none"}, "fillOpacity": 10 if stack else 0},
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [_target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(queries)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]}},
        "gridPos": {"w": width, "h": height},
    }


def stat(
    title: str, expr: str, unit: str, *, description: str = "", width: int = 6, decimals: int = 2
) -> Panel:
    """A single-number panel."""
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [_target(expr, title, "A")],
        "fieldConfig": {"defaults": {"unit": unit, "decimals": decimals}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
        "gridPos": {"w": width, "h": 4},
    }


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": WIDTH, "h": 1}}


def quantiles(metric: str, by: str, selector: str) -> list[tuple[str, str]]:
    """p50/p95/p99 of a Prometheus histogram, aggregated ``by`` a label."""
    return [
        (
            f"histogram_quantile({q}, {sum_rate(f'le, {by}', f'{metric}_bucket', selector)})",
            f"p{round(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def query_var(name: str, label: str, query: str, *, multi: bool = True) -> dict[str, Any]:
    return {
        "type": "query",
        "name": name,
        "label": label,
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "includeAll": multi,
        "multi": multi,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if multi else {},
        "sort": 1,
    }


def datasource_var() -> dict[str, Any]:
    return {
        "type": "datasource",
        "name": "datasource",
        "label": "Data source",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "refresh": 1,
        "regex": "",
    }


def _layout(panels: list[Panel]) -> list[Panel]:
    """Place panels left to right, wrapping at the grid width; rows start a new line. Ids follow order."""
    x = y = line_height = 0
    placed: list[Panel] = []
    for pid, panel in enumerate(panels, start=1):
        w, h = panel["gridPos"]["w"], panel["gridPos"]["h"]
        if panel["type"] == "row" or x + w > WIDTH:
            x, y, line_height = 0, y + line_height, 0
        placed.append({**panel, "id": pid, "gridPos": {"x": x, "y": y, "w": w, "h": h}})
        x += w
        line_height = max(line_height, h)
        if panel["type"] == "row":
            x, y, line_height = 0, y + h, 0
    return placed


def dashboard(
    uid: str, title: str, description: str, variables: list[dict[str, Any]], panels: list[Panel]
) -> Dashboard:
    # No "id": Grafana assigns instance ids; a stable string uid is what links and provisioning use.
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["sarv"],
        "timezone": "browser",
        "editable": False,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": [datasource_var(), *variables]},
        "annotations": {"list": []},
        "links": [{"type": "dashboards", "tags": ["sarv"], "asDropdown": True, "title": "Sarv"}],
        "panels": _layout(panels),
    }


def fleet() -> Dashboard:
    """GPU nodes: DCGM exporter (per GPU) and node exporter (per host)."""
    gpu = 'Hostname=~"$node"'
    host = 'instance=~"$instance"'
    idle = f'mode="idle", {host}'
    nic = f'device!="lo", {host}'
    return dashboard(
        "sarv-fleet",
        "Sarv / Fleet and GPUs",
        "GPU utilisation, memory, temperature, power and XID errors (DCGM exporter), host CPU, memory, "
        "disk and network (node exporter).",
        [
            query_var("node", "GPU node", "label_values(DCGM_FI_DEV_GPU_UTIL, Hostname)"),
            query_var("instance", "Host (node exporter)", "label_values(node_uname_info, instance)"),
        ],
        [
            row("GPUs"),
            stat("GPUs reporting", f"count(DCGM_FI_DEV_GPU_UTIL{{{gpu}}})", "none", decimals=0),
            stat("Mean GPU utilisation", f"avg(DCGM_FI_DEV_GPU_UTIL{{{gpu}}})", "percent"),
            stat(
                "GPU memory in use",
                f"sum(DCGM_FI_DEV_FB_USED{{{gpu}}})"
                f" / sum(DCGM_FI_DEV_FB_USED{{{gpu}}} + DCGM_FI_DEV_FB_FREE{{{gpu}}})",
                "percentunit",
                description="vLLM reserves gpu_memory_utilization of each GPU at start: high is normal.",
            ),
            stat(
                "XID errors (1h)",
                f"count(changes(DCGM_FI_DEV_XID_ERRORS{{{gpu}}}[1h]) > 0) or vector(0)",
                "none",
                decimals=0,
                description="GPUs whose last XID error code changed in the past hour (driver faults).",
            ),
            timeseries(
                "GPU utilisation",
                [(f"DCGM_FI_DEV_GPU_UTIL{{{gpu}}}", "{{Hostname}} GPU {{gpu}}")],
                "percent",
                maximum=100,
            ),
            timeseries(
                "GPU memory used",
                [(f"DCGM_FI_DEV_FB_USED{{{gpu}}} * 1024 * 1024", "{{Hostname}} GPU {{gpu}}")],
                "bytes",
                description="DCGM reports MiB; converted to bytes for the unit.",
            ),
            timeseries(
                "GPU temperature", [(f"DCGM_FI_DEV_GPU_TEMP{{{gpu}}}", "{{Hostname}} GPU {{gpu}}")], "celsius"
            ),
            timeseries(
                "GPU power", [(f"DCGM_FI_DEV_POWER_USAGE{{{gpu}}}", "{{Hostname}} GPU {{gpu}}")], "watt"
            ),
            row("Hosts"),
            timeseries(
                "CPU busy",
                [
                    (
                        f"1 - avg by (instance) ({rate('node_cpu_seconds_total', idle)})",
                        "{{instance}}",
                    )
                ],
                "percentunit",
                maximum=1,
            ),
            timeseries(
                "Memory available",
                [(f"node_memory_MemAvailable_bytes{{{host}}}", "{{instance}}")],
                "bytes",
            ),
            timeseries(
                "Model cache free space",
                [
                    (
                        f'node_filesystem_avail_bytes{{fstype!~"tmpfs|overlay", {host}}}',
                        "{{instance}} {{mountpoint}}",
                    )
                ],
                "bytes",
            ),
            timeseries(
                "Network",
                [
                    (
                        rate("node_network_receive_bytes_total", nic) + " * 8",
                        "{{instance}} {{device}} in",
                    ),
                    (
                        rate("node_network_transmit_bytes_total", nic) + " * 8",
                        "{{instance}} {{device}} out",
                    ),
                ],
                "bps",
            ),
        ],
    )


def replicas() -> Dashboard:
    """vLLM engine metrics per replica (labels from the engine and from Sarv's file_sd targets)."""
    sel = 'model_name=~"$model", replica=~"$replica"'
    return dashboard(
        "sarv-replicas",
        "Sarv / Replicas (vLLM)",
        "Load, KV cache, prefix cache, latency and token throughput of each vLLM replica.",
        [
            query_var("model", "Model", "label_values(vllm:num_requests_running, model_name)"),
            query_var(
                "replica", "Replica", 'label_values(vllm:num_requests_running{model_name=~"$model"}, replica)'
            ),
        ],
        [
            row("Load"),
            timeseries(
                "Requests running",
                [(f"sum by (replica) (vllm:num_requests_running{{{sel}}})", "{{replica}}")],
                "none",
                stack=True,
            ),
            timeseries(
                "Requests waiting",
                [(f"sum by (replica) (vllm:num_requests_waiting{{{sel}}})", "{{replica}}")],
                "none",
                description="Queued in the engine; sustained waiting is the scale-up signal.",
            ),
            timeseries(
                "KV cache usage",
                [(f"max by (replica) (vllm:kv_cache_usage_perc{{{sel}}})", "{{replica}}")],
                "percentunit",
                maximum=1,
                description="Fraction of KV cache blocks in use (1 = full: new requests wait or preempt).",
            ),
            timeseries(
                "Prefix cache hit rate",
                [
                    (
                        sum_rate("replica", "vllm:prefix_cache_hits_total", sel)
                        + " / "
                        + sum_rate("replica", "vllm:prefix_cache_queries_total", sel),
                        "{{replica}}",
                    )
                ],
                "percentunit",
                maximum=1,
                description="Share of prompt tokens served from the prefix cache.",
            ),
            row("Latency"),
            timeseries(
                "Time to first token",
                quantiles("vllm:time_to_first_token_seconds", "model_name", sel),
                "s",
            ),
            timeseries(
                "Inter-token latency",
                quantiles("vllm:inter_token_latency_seconds", "model_name", sel),
                "s",
            ),
            timeseries(
                "End-to-end request latency",
                quantiles("vllm:e2e_request_latency_seconds", "model_name", sel),
                "s",
            ),
            timeseries(
                "Queue time",
                quantiles("vllm:request_queue_time_seconds", "model_name", sel),
                "s",
            ),
            row("Throughput"),
            timeseries(
                "Tokens per second",
                [
                    (
                        sum_rate("replica", "vllm:prompt_tokens_total", sel),
                        "prompt {{replica}}",
                    ),
                    (
                        sum_rate("replica", "vllm:generation_tokens_total", sel),
                        "generation {{replica}}",
                    ),
                ],
                "short",
            ),
            timeseries(
                "Finished requests by reason",
                [
                    (
                        sum_rate("finished_reason", "vllm:request_success_total", sel),
                        "{{finished_reason}}",
                    )
                ],
                "reqps",
                stack=True,
            ),
            timeseries(
                "Preemptions",
                [
                    (
                        sum_rate("replica", "vllm:num_preemptions_total", sel),
                        "{{replica}}",
                    )
                ],
                "short",
                description="Requests evicted from the KV cache and recomputed: the cache is too small.",
            ),
            timeseries(
                "Scrape health",
                [('up{replica=~"$replica", replica!=""}', "{{replica}} ({{node}})")],
                "none",
                maximum=1,
            ),
        ],
    )


def gateway() -> Dashboard:
    """The OpenAI-compatible gateway: traffic, latency, tokens per key, refusals, routing."""
    m = 'model=~"$model"'
    server_error = f'status=~"5..", {m}'
    return dashboard(
        "sarv-gateway",
        "Sarv / Gateway",
        "Requests, errors, latency as clients see it, tokens per API key, rate-limit and validation "
        "refusals, routing decisions and upstream errors.",
        [query_var("model", "Model", "label_values(sarv_gateway_requests_total, model)")],
        [
            row("Traffic"),
            stat(
                "Requests/s",
                f"sum({rate('sarv_gateway_requests_total', m)})",
                "reqps",
            ),
            stat(
                "Server errors",
                f"sum({rate('sarv_gateway_requests_total', server_error)})"
                f" / sum({rate('sarv_gateway_requests_total', m)})",
                "percentunit",
                description="Share of 5xx answers. Client mistakes are 4xx and never count here.",
            ),
            stat("Ready replicas", 'sum(sarv_gateway_replicas{state="ready"})', "none", decimals=0),
            stat(
                "Retries/s",
                f"sum({rate('sarv_gateway_retries_total')})",
                "reqps",
            ),
            timeseries(
                "Requests by status",
                [
                    (
                        sum_rate("status", "sarv_gateway_requests_total", m),
                        "{{status}}",
                    )
                ],
                "reqps",
                stack=True,
            ),
            timeseries(
                "Requests by model",
                [
                    (
                        sum_rate("model", "sarv_gateway_requests_total", m),
                        "{{model}}",
                    )
                ],
                "reqps",
                stack=True,
            ),
            row("Latency (client view)"),
            timeseries("Time to first token", quantiles("sarv_gateway_ttft_seconds", "model", m), "s"),
            timeseries("Inter-token latency", quantiles("sarv_gateway_itl_seconds", "model", m), "s"),
            timeseries("End-to-end latency", quantiles("sarv_gateway_e2e_seconds", "model", m), "s"),
            timeseries(
                "Time queued in the gateway",
                quantiles("sarv_gateway_queue_seconds", "model", m),
                "s",
                description="Held before a replica was chosen (e.g. while one starts from zero).",
            ),
            row("Tokens and keys"),
            timeseries(
                "Prompt tokens/s by key",
                [
                    (
                        sum_rate("key", "sarv_gateway_prompt_tokens_total", m),
                        "{{key}}",
                    )
                ],
                "short",
                stack=True,
            ),
            timeseries(
                "Completion tokens/s by key",
                [
                    (
                        sum_rate("key", "sarv_gateway_completion_tokens_total", m),
                        "{{key}}",
                    )
                ],
                "short",
                stack=True,
            ),
            timeseries(
                "Rate-limit refusals",
                [
                    (
                        sum_rate("key, reason", "sarv_gateway_ratelimit_rejections_total"),
                        "{{key}} {{reason}}",
                    )
                ],
                "reqps",
            ),
            timeseries(
                "Validation refusals",
                [
                    (
                        sum_rate("reason", "sarv_gateway_validation_rejections_total"),
                        "{{reason}}",
                    )
                ],
                "reqps",
                description="Requests refused before any replica saw them (oversized, bad parameters …).",
            ),
            row("Routing"),
            timeseries(
                "Routing decisions by replica",
                [
                    (
                        sum_rate("policy, replica", "sarv_gateway_routing_decisions_total"),
                        "{{policy}} → {{replica}}",
                    )
                ],
                "reqps",
                stack=True,
            ),
            timeseries(
                "Upstream errors by replica",
                [
                    (
                        sum_rate("replica", "sarv_gateway_upstream_errors_total"),
                        "{{replica}}",
                    )
                ],
                "reqps",
            ),
            timeseries(
                "Replicas by state",
                [("sum by (state) (sarv_gateway_replicas)", "{{state}}")],
                "none",
                stack=True,
                width=24,
            ),
        ],
    )


DASHBOARDS: tuple[Callable[[], Dashboard], ...] = (fleet, replicas, gateway)


def render_all() -> dict[str, str]:
    """``{file name: JSON text}`` for every dashboard, deterministic byte for byte."""
    out: dict[str, str] = {}
    for build in DASHBOARDS:
        board = build()
        out[f"{board['uid']}.json"] = json.dumps(board, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    return out


def write_all(directory: Path) -> list[Path]:
    written = []
    for name, text in render_all().items():
        path = directory / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
    for p in write_all(target):
        sys.stdout.write(f"wrote {p}\n")
