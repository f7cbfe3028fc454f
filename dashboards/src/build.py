"""Sarv's Grafana dashboards as code: run ``python dashboards/src/build.py`` to regenerate dashboards/*.json.

Built with grafana-foundation-sdk (Grafana's own typed models of the dashboard schema, the ``dev`` extra):
a panel option, variable or link that the schema does not have is an error here, not a dashboard that
Grafana rejects on load. Every panel queries the ``$datasource`` template variable, every ``rate()`` uses
``$__rate_interval``, every panel has a unit, and engine series are read through the recorded ``sarv:*``
series of dashboards/rules/sarv.rules.yml (stable across engines and vLLM versions). Selectors use
deployment, model and node, never job or instance. Never edit the rendered JSON by hand; CI regenerates it
and fails on any difference.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus as pb
from grafana_foundation_sdk.builders import stat as sb
from grafana_foundation_sdk.builders import timeseries as tb
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

Panel = tb.Panel | sb.Panel | db.Row
Dashboard = dict[str, Any]

DATASOURCE = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
WIDTH = 24
# Dashboards link to each other by uid: fleet → replicas → GPU nodes, carrying the shared variables.
UIDS = {
    "fleet": "sarv-fleet",
    "replicas": "sarv-replicas",
    "gpu-nodes": "sarv-gpu-nodes",
    "capacity": "sarv-capacity",
    "gateway": "sarv-gateway",
    "tenants": "sarv-tenants",
}


def rate(metric: str, selector: str = "", func: str = "rate") -> str:
    """``rate()`` over Grafana's ``$__rate_interval`` (at least four scrape intervals, never too short)."""
    sel = f"{{{selector}}}" if selector else ""
    return f"{func}({metric}{sel}[$__rate_interval])"


def sum_rate(by: str, metric: str, selector: str = "", func: str = "rate") -> str:
    return f"sum by ({by}) ({rate(metric, selector, func)})"


def _query(expr: str, legend: str, ref: str) -> pb.Dataquery:
    return pb.Dataquery().datasource(DATASOURCE).expr(expr).legend_format(legend).ref_id(ref)


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
) -> tb.Panel:
    """A time series panel; ``queries`` are ``(expr, legendFormat)`` pairs."""
    panel = (
        tb.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .fill_opacity(10 if stack else 0)
        .stacking(cb.StackingConfig().mode(cm.StackingMode.NORMAL if stack else cm.StackingMode.NONE))
        .legend(
            cb.VizLegendOptions()
            .display_mode(cm.LegendDisplayMode.TABLE)
            .placement(cm.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["mean", "max"])
        )
    )
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(_query(expr, legend, chr(ord("A") + i)))
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    return panel


def stat(
    title: str, expr: str, unit: str, *, description: str = "", width: int = 6, decimals: int = 2
) -> sb.Panel:
    """A single-number panel."""
    return (
        sb.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(_query(expr, title, "A"))
        .unit(unit)
        .decimals(decimals)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]))
        .color_mode(cm.BigValueColorMode.VALUE)
        .span(width)
        .height(4)
    )


def row(title: str) -> db.Row:
    return db.Row(title)


def quantiles(recorded: str, by: str, selector: str) -> list[tuple[str, str]]:
    """p50/p95/p99 of a recorded per-replica bucket rate (``sarv:*_bucket:rate5m``), aggregated ``by``."""
    return [
        (
            f"histogram_quantile({q}, sum by (le, {by}) ({recorded}{{{selector}}}))",
            f"p{round(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def query_var(name: str, label: str, query: str) -> db.QueryVariable:
    """A multi-value variable with "All" (``.*``) filled from a Prometheus ``label_values`` query."""
    return (
        db.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .multi(True)
        .all_value(".*")
        .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )


def datasource_var() -> db.DatasourceVariable:
    return db.DatasourceVariable("datasource").label("Data source").type("prometheus")


def link_to(view: str, title: str) -> db.DashboardLink:
    """A link to another Sarv view that keeps the time range and the variables both views share."""
    return (
        db.DashboardLink(title)
        .type(dm.DashboardLinkType.LINK)
        .url(f"/d/{UIDS[view]}")
        .include_vars(True)
        .keep_time(True)
        .icon("dashboard")
    )


def annotation(name: str, expr: str, color: str) -> db.AnnotationQuery:
    """Events drawn on every time series panel, from a Prometheus query (a series > 0 marks a moment)."""
    return db.AnnotationQuery().name(name).datasource(DATASOURCE).enable(True).icon_color(color).expr(expr)


def dashboard(
    key: str,
    title: str,
    description: str,
    variables: list[db.QueryVariable],
    panels: list[Panel],
    *,
    links: list[db.DashboardLink] | None = None,
    annotations: list[db.AnnotationQuery] | None = None,
) -> Dashboard:
    # No "id": Grafana assigns instance ids; a stable string uid is what links and provisioning use.
    board = (
        db.Dashboard(title)
        .uid(UIDS[key])
        .description(description)
        .tags(["sarv"])
        .timezone("browser")
        .readonly()
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-3h", "now")
        .with_variable(datasource_var())
        .links(
            [
                *(links or []),
                db.DashboardLink("Sarv")
                .type(dm.DashboardLinkType.DASHBOARDS)
                .tags(["sarv"])
                .as_dropdown(True),
            ]
        )
    )
    for variable in variables:
        board = board.with_variable(variable)
    for note in annotations or []:
        board = board.annotation(note)
    for pid, panel in enumerate(panels, start=1):
        numbered = panel.id(pid)
        board = board.with_row(numbered) if isinstance(numbered, db.Row) else board.with_panel(numbered)
    encoded = JSONEncoder(sort_keys=True).encode(board.build())
    return json.loads(encoded)  # type: ignore[no-any-return]


def fleet() -> Dashboard:
    """Fleet overview: every deployment's replicas, load and latency, and GPU use per node."""
    dep = 'deployment=~"$deployment", node=~"$node"'
    d = 'deployment=~"$deployment"'
    m = 'model=~"$model"'
    return dashboard(
        "fleet",
        "Sarv / Fleet",
        "What runs where: replicas up per deployment, engine queues and KV cache, token throughput, "
        "first-token latency, gateway traffic and GPU utilisation per node. Follow the links to one "
        "replica and to one GPU node.",
        [
            query_var("deployment", "Deployment", "label_values(sarv:replica_up, deployment)"),
            query_var("model", "Model", "label_values(sarv:replica_up, model)"),
            query_var("node", "Node", "label_values(sarv:replica_up, node)"),
        ],
        [
            row("Now"),
            stat(
                "Replicas up",
                f"sum(sarv:replica_up{{{dep}, {m}}})",
                "none",
                decimals=0,
                description="Replica targets Prometheus scrapes successfully.",
            ),
            stat(
                "Replicas down",
                f"count(sarv:replica_up{{{dep}, {m}}} == 0) or vector(0)",
                "none",
                decimals=0,
            ),
            stat("Gateway requests/s", f"sum(sarv:gateway_requests:rate5m{{{m}}})", "reqps"),
            stat(
                "GPU utilisation",
                'avg(sarv:node_gpu_utilization:avg{node=~"$node"})',
                "percentunit",
                description="Mean over the GPUs of the selected nodes (DCGM exporter).",
            ),
            row("Deployments"),
            timeseries(
                "Replicas up by deployment",
                [(f"sum by (deployment) (sarv:replica_up{{{dep}, {m}}})", "{{deployment}}")],
                "none",
                stack=True,
            ),
            timeseries(
                "Requests waiting by deployment",
                [(f"sarv:deployment_requests_waiting:sum{{{d}, {m}}}", "{{deployment}}")],
                "none",
                description="Queued in the engines; sustained waiting is the scale-up signal.",
            ),
            timeseries(
                "KV cache usage by deployment",
                [(f"sarv:deployment_kv_cache_usage:max{{{d}, {m}}}", "{{deployment}}")],
                "percentunit",
                maximum=1,
                description="The fullest replica's KV cache (1 = full).",
            ),
            timeseries(
                "Generated tokens/s by deployment",
                [(f"sarv:deployment_generation_tokens:rate5m{{{d}, {m}}}", "{{deployment}}")],
                "short",
                stack=True,
            ),
            timeseries(
                "Time to first token p95 by deployment",
                [(f"sarv:deployment_ttft_seconds:p95_5m{{{d}, {m}}}", "{{deployment}}")],
                "s",
                description="Measured in the engines; the gateway view adds queueing in the gateway.",
            ),
            timeseries(
                "Gateway 5xx ratio by model",
                [("sarv:gateway_error_ratio:rate5m", "{{model}}")],
                "percentunit",
                maximum=1,
            ),
            row("GPU nodes"),
            timeseries(
                "GPU utilisation by node",
                [('sarv:node_gpu_utilization:avg{node=~"$node"}', "{{node}}")],
                "percentunit",
                maximum=1,
                width=24,
            ),
        ],
        links=[
            link_to("replicas", "Replicas"),
            link_to("gpu-nodes", "GPU nodes"),
            link_to("capacity", "Capacity"),
        ],
    )


def replicas() -> Dashboard:
    """Engine metrics per replica, read through the engine-independent ``sarv:replica_*`` series."""
    sel = 'deployment=~"$deployment", replica=~"$replica", node=~"$node"'
    return dashboard(
        "replicas",
        "Sarv / Replicas",
        "Load, KV cache, prefix cache, latency and token throughput of each replica, whatever its engine "
        "(vllm, vllm-cpu, sim) and vLLM version.",
        [
            query_var("deployment", "Deployment", "label_values(sarv:replica_up, deployment)"),
            query_var(
                "replica", "Replica", 'label_values(sarv:replica_up{deployment=~"$deployment"}, replica)'
            ),
            query_var("node", "Node", 'label_values(sarv:replica_up{deployment=~"$deployment"}, node)'),
        ],
        [
            row("Load"),
            timeseries(
                "Requests running",
                [(f"sarv:replica_requests_running{{{sel}}}", "{{replica}}")],
                "none",
                stack=True,
            ),
            timeseries(
                "Requests waiting",
                [(f"sarv:replica_requests_waiting{{{sel}}}", "{{replica}}")],
                "none",
                description="Queued in the engine; sustained waiting is the scale-up signal.",
            ),
            timeseries(
                "KV cache usage",
                [(f"sarv:replica_kv_cache_usage:ratio{{{sel}}}", "{{replica}}")],
                "percentunit",
                maximum=1,
                description="Fraction of KV cache blocks in use (1 = full: new requests wait or preempt).",
            ),
            timeseries(
                "Prefix cache hit rate",
                [(f"sarv:replica_prefix_cache_hit:ratio_rate5m{{{sel}}}", "{{replica}}")],
                "percentunit",
                maximum=1,
                description="Share of prompt tokens served from the prefix cache.",
            ),
            row("Latency"),
            timeseries(
                "Time to first token",
                quantiles("sarv:replica_ttft_seconds_bucket:rate5m", "deployment", sel),
                "s",
            ),
            timeseries(
                "Inter-token latency",
                quantiles("sarv:replica_itl_seconds_bucket:rate5m", "deployment", sel),
                "s",
            ),
            timeseries(
                "End-to-end request latency",
                quantiles("sarv:replica_e2e_seconds_bucket:rate5m", "deployment", sel),
                "s",
            ),
            timeseries(
                "Queue time",
                quantiles("sarv:replica_queue_seconds_bucket:rate5m", "deployment", sel),
                "s",
            ),
            row("Throughput"),
            timeseries(
                "Tokens per second",
                [
                    (f"sarv:replica_prompt_tokens:rate5m{{{sel}}}", "prompt {{replica}}"),
                    (f"sarv:replica_generation_tokens:rate5m{{{sel}}}", "generation {{replica}}"),
                ],
                "short",
            ),
            timeseries(
                "Finished requests by reason",
                [
                    (
                        f"sum by (finished_reason) (sarv:replica_finished_requests:rate5m{{{sel}}})",
                        "{{finished_reason}}",
                    )
                ],
                "reqps",
                stack=True,
            ),
            timeseries(
                "Preemptions",
                [(f"sarv:replica_preemptions:rate5m{{{sel}}}", "{{replica}}")],
                "short",
                description="Requests evicted from the KV cache and recomputed: the cache is too small.",
            ),
            timeseries(
                "Scrape health",
                [(f"sarv:replica_up{{{sel}}}", "{{replica}} ({{node}}, {{engine_kind}})")],
                "none",
                maximum=1,
            ),
        ],
        links=[link_to("fleet", "Fleet"), link_to("gpu-nodes", "GPU nodes of these replicas")],
    )


def gpu_nodes() -> Dashboard:
    """GPU nodes: DCGM exporter (per GPU) and node exporter (model cache disk, interconnect NIC)."""
    gpu = 'node=~"$node", gpu=~"$gpu"'
    host = 'node=~"$node"'
    nic = f'device=~"$nic", {host}'
    disk = f'device=~"$disk", {host}'
    idle = f'mode="idle", {host}'
    real_fs = 'fstype!~"tmpfs|overlay"'
    per_gpu = "{{node}} GPU {{gpu}}"
    return dashboard(
        "gpu-nodes",
        "Sarv / GPU nodes",
        "Per GPU (DCGM exporter): utilisation, memory, temperature, power, XID and ECC errors, NVLink and "
        "PCIe throughput; per host (node exporter): the model cache's disk and space, the interconnect NIC.",
        [
            query_var("node", "Node", "label_values(DCGM_FI_DEV_GPU_UTIL, node)"),
            query_var("gpu", "GPU", 'label_values(DCGM_FI_DEV_GPU_UTIL{node=~"$node"}, gpu)'),
            query_var(
                "mountpoint",
                "Model cache mount",
                'label_values(node_filesystem_avail_bytes{node=~"$node", fstype!~"tmpfs|overlay"},'
                " mountpoint)",
            ),
            query_var("disk", "Disk", 'label_values(node_disk_read_bytes_total{node=~"$node"}, device)'),
            query_var(
                "nic",
                "Interconnect NIC",
                'label_values(node_network_receive_bytes_total{node=~"$node", device!="lo"}, device)',
            ),
        ],
        [
            row("GPUs"),
            stat("GPUs reporting", f"count(DCGM_FI_DEV_GPU_UTIL{{{gpu}}})", "none", decimals=0),
            stat("Mean GPU utilisation", f"avg(sarv:gpu_utilization:ratio{{{gpu}}})", "percentunit"),
            stat(
                "GPU memory in use",
                f"avg(sarv:gpu_memory_used:ratio{{{gpu}}})",
                "percentunit",
                description="vLLM reserves gpu_memory_utilization of each GPU at start: high is normal.",
            ),
            stat(
                "GPUs with XID or ECC errors (time range)",
                f"count((changes(DCGM_FI_DEV_XID_ERRORS{{{gpu}}}[$__range]) > 0)"
                f" or (increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{gpu}}}[$__range]) > 0)) or vector(0)",
                "none",
                decimals=0,
                description="GPUs whose XID code changed or with a double-bit ECC error in the time range.",
            ),
            timeseries(
                "GPU utilisation",
                [(f"sarv:gpu_utilization:ratio{{{gpu}}}", per_gpu)],
                "percentunit",
                maximum=1,
            ),
            timeseries(
                "GPU memory used",
                [(f"DCGM_FI_DEV_FB_USED{{{gpu}}} * 1024 * 1024", per_gpu)],
                "bytes",
                description="DCGM reports MiB; converted to bytes for the unit.",
            ),
            timeseries("GPU temperature", [(f"DCGM_FI_DEV_GPU_TEMP{{{gpu}}}", per_gpu)], "celsius"),
            timeseries("GPU power", [(f"DCGM_FI_DEV_POWER_USAGE{{{gpu}}}", per_gpu)], "watt"),
            timeseries(
                "Last XID error code",
                [(f"DCGM_FI_DEV_XID_ERRORS{{{gpu}}}", per_gpu)],
                "none",
                description="0 until the driver reports a fault; then the code in NVIDIA's XID table.",
            ),
            timeseries(
                "ECC errors",
                [
                    (
                        sum_rate("node, gpu", "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", gpu, "increase"),
                        "single-bit " + per_gpu,
                    ),
                    (
                        sum_rate("node, gpu", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", gpu, "increase"),
                        "double-bit " + per_gpu,
                    ),
                ],
                "short",
                description="Volatile counts since the last GPU reset; any double-bit error is an alert.",
            ),
            row("Interconnect"),
            timeseries(
                "NVLink throughput",
                [
                    (f"DCGM_FI_PROF_NVLINK_TX_BYTES{{{gpu}}}", "tx " + per_gpu),
                    (f"DCGM_FI_PROF_NVLINK_RX_BYTES{{{gpu}}}", "rx " + per_gpu),
                ],
                "Bps",
                description="Tensor-parallel traffic between the GPUs of a node (DCGM profiling fields).",
            ),
            timeseries(
                "PCIe throughput",
                [
                    (f"DCGM_FI_PROF_PCIE_TX_BYTES{{{gpu}}}", "tx " + per_gpu),
                    (f"DCGM_FI_PROF_PCIE_RX_BYTES{{{gpu}}}", "rx " + per_gpu),
                ],
                "Bps",
                description="Host ↔ GPU traffic: weight loading, and KV or activations without NVLink.",
            ),
            timeseries(
                "Interconnect NIC",
                [
                    (rate("node_network_receive_bytes_total", nic) + " * 8", "{{node}} {{device}} in"),
                    (rate("node_network_transmit_bytes_total", nic) + " * 8", "{{node}} {{device}} out"),
                ],
                "bps",
                description="Pipeline-parallel traffic between nodes and weight copies from peers.",
            ),
            timeseries(
                "NIC errors and drops",
                [
                    (
                        sum_rate("node, device", "node_network_receive_errs_total", nic),
                        "{{node}} {{device}} rx errors",
                    ),
                    (
                        sum_rate("node, device", "node_network_receive_drop_total", nic),
                        "{{node}} {{device}} rx drops",
                    ),
                    (
                        sum_rate("node, device", "node_network_transmit_errs_total", nic),
                        "{{node}} {{device}} tx errors",
                    ),
                ],
                "pps",
            ),
            row("Model cache and host"),
            timeseries(
                "Model cache free space",
                [
                    (
                        f'node_filesystem_avail_bytes{{mountpoint=~"$mountpoint", {real_fs}, {host}}}',
                        "{{node}} {{mountpoint}}",
                    )
                ],
                "bytes",
            ),
            timeseries(
                "Model cache disk throughput",
                [
                    (rate("node_disk_read_bytes_total", disk), "{{node}} {{device}} read"),
                    (rate("node_disk_written_bytes_total", disk), "{{node}} {{device}} write"),
                ],
                "Bps",
                description="Reads while engines load weights; writes while weights are downloaded.",
            ),
            timeseries(
                "CPU busy",
                [(f"1 - avg by (node) ({rate('node_cpu_seconds_total', idle)})", "{{node}}")],
                "percentunit",
                maximum=1,
            ),
            timeseries(
                "Memory available",
                [(f"node_memory_MemAvailable_bytes{{{host}}}", "{{node}}")],
                "bytes",
            ),
        ],
        links=[link_to("fleet", "Fleet"), link_to("replicas", "Replicas on this node")],
    )


def capacity() -> Dashboard:
    """GPUs allocated and free, replicas desired/current/ready, unplaced replicas and scaling decisions."""
    d = 'deployment=~"$deployment"'
    n = 'node=~"$node", gpu_type=~"$gpu_type"'
    desired = f'state="desired", {d}'
    return dashboard(
        "capacity",
        "Sarv / Capacity",
        "GPUs allocated and free per node and GPU type, replicas per deployment by state, replicas that "
        "cannot be placed and why, the autoscaler's decisions and the controller's events (annotated).",
        [
            query_var("deployment", "Deployment", "label_values(sarv_deployment_replicas, deployment)"),
            query_var("node", "Node", "label_values(sarv_node_gpus, node)"),
            query_var("gpu_type", "GPU type", 'label_values(sarv_node_gpus{node=~"$node"}, gpu_type)'),
        ],
        [
            row("GPUs"),
            stat("GPUs free", f'sum(sarv_node_gpus{{state="free", {n}}})', "none", decimals=0),
            stat("GPUs allocated", f'sum(sarv_node_gpus{{state="allocated", {n}}})', "none", decimals=0),
            stat(
                "Nodes cordoned",
                'count(sarv_node_schedulable{node=~"$node"} == 0) or vector(0)',
                "none",
                decimals=0,
                description="Nodes taking no new replicas (`llmctl cordon NODE`).",
            ),
            stat(
                "Replicas unplaced",
                f"sum(sarv_deployment_unplaced_replicas{{{d}}}) or vector(0)",
                "none",
                decimals=0,
            ),
            timeseries(
                "GPUs by node",
                [(f"sum by (node, state) (sarv_node_gpus{{{n}}})", "{{node}} {{state}}")],
                "none",
                stack=True,
            ),
            timeseries(
                "GPUs by type",
                [(f"sum by (gpu_type, state) (sarv_node_gpus{{{n}}})", "{{gpu_type}} {{state}}")],
                "none",
                stack=True,
            ),
            timeseries(
                "Schedulable nodes",
                [('sarv_node_schedulable{node=~"$node"}', "{{node}}")],
                "none",
                maximum=1,
                width=24,
                height=6,
            ),
            row("Replicas"),
            timeseries(
                "Replicas by state",
                [
                    (
                        f"sum by (deployment, state) (sarv_deployment_replicas{{{d}}})",
                        "{{deployment}} {{state}}",
                    )
                ],
                "none",
                description="desired (asked for), current (exist), ready, loading, pending (unplaced).",
            ),
            timeseries(
                "Unplaced replicas by reason",
                [
                    (
                        f"sum by (deployment, reason) (sarv_deployment_unplaced_replicas{{{d}}})",
                        "{{deployment}}: {{reason}}",
                    )
                ],
                "none",
            ),
            timeseries(
                "Recommended and current replicas",
                [
                    (f"sarv_controller_recommended_replicas{{{d}}}", "recommended {{deployment}}"),
                    (f"sarv_controller_current_replicas{{{d}}}", "current {{deployment}}"),
                ],
                "none",
                description="What the autoscaling policy recommends against what exists.",
            ),
            timeseries(
                "Autoscaler decisions",
                [
                    (
                        sum_rate("deployment, direction", "sarv_autoscaler_decisions_total", d, "increase"),
                        "{{deployment}} {{direction}}",
                    )
                ],
                "short",
            ),
            timeseries(
                "Controller events",
                [
                    (
                        sum_rate("reason, type", "sarv_controller_events_total", "", "increase"),
                        "{{type}} {{reason}}",
                    )
                ],
                "short",
                width=24,
            ),
        ],
        links=[link_to("fleet", "Fleet"), link_to("replicas", "Replicas")],
        annotations=[
            annotation(
                "Scale",
                f"sum by (deployment) ({rate('sarv_deployment_replicas', desired, 'changes')}) > 0",
                "blue",
            ),
            annotation(
                "Controller events",
                f"sum by (reason) ({rate('sarv_controller_events_total', '', 'increase')}) > 0",
                "orange",
            ),
        ],
    )


def gw_quantiles(metric: str, selector: str) -> list[tuple[str, str]]:
    """p50/p95/p99 of one of the gateway's own histograms by model."""
    return [
        (
            f"histogram_quantile({q}, {sum_rate('le, model', f'{metric}_bucket', selector)})",
            f"p{round(q * 100)} {{{{model}}}}",
        )
        for q in (0.5, 0.95, 0.99)
    ]


def gateway() -> Dashboard:
    """The OpenAI-compatible gateway: traffic, latency, tokens per key, refusals, routing."""
    m = 'model=~"$model"'
    server_error = f'status=~"5..", {m}'
    return dashboard(
        "gateway",
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
                # "or vector(0)": with no 5xx at all there is no 5xx series; show 0 %, not "No data".
                f"(sum({rate('sarv_gateway_requests_total', server_error)}) or vector(0))"
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
            timeseries("Time to first token", gw_quantiles("sarv_gateway_ttft_seconds", m), "s"),
            timeseries("Inter-token latency", gw_quantiles("sarv_gateway_itl_seconds", m), "s"),
            timeseries("End-to-end latency", gw_quantiles("sarv_gateway_e2e_seconds", m), "s"),
            timeseries(
                "Time queued in the gateway",
                gw_quantiles("sarv_gateway_queue_seconds", m),
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
        links=[link_to("fleet", "Fleet"), link_to("tenants", "Tenants")],
    )


def tenants() -> Dashboard:
    """Per team and API key: requests, tokens, cost and refusals (the gateway's ``team`` label)."""
    t = 'team=~"$team", key=~"$key", model=~"$model"'
    tk = 'team=~"$team", key=~"$key"'
    return dashboard(
        "tenants",
        "Sarv / Tenants",
        "Requests, tokens and cost per team and API key, and the requests the gateway refused (rate limits "
        "by reason) for each.",
        [
            query_var("team", "Team", "label_values(sarv_gateway_requests_total, team)"),
            query_var("key", "API key", 'label_values(sarv_gateway_requests_total{team=~"$team"}, key)'),
            query_var("model", "Model", 'label_values(sarv_gateway_requests_total{team=~"$team"}, model)'),
        ],
        [
            row("Teams"),
            timeseries(
                "Requests/s by team",
                [(sum_rate("team", "sarv_gateway_requests_total", t), "{{team}}")],
                "reqps",
                stack=True,
            ),
            timeseries(
                "Requests/s by team and status",
                [(sum_rate("team, status", "sarv_gateway_requests_total", t), "{{team}} {{status}}")],
                "reqps",
            ),
            timeseries(
                "Prompt tokens/s by team",
                [(sum_rate("team", "sarv_gateway_prompt_tokens_total", t), "{{team}}")],
                "short",
                stack=True,
            ),
            timeseries(
                "Completion tokens/s by team",
                [(sum_rate("team", "sarv_gateway_completion_tokens_total", t), "{{team}}")],
                "short",
                stack=True,
            ),
            timeseries(
                "Cost by team",
                [(sum_rate("team", "sarv_gateway_cost_total", t, "increase"), "{{team}}")],
                "short",
                stack=True,
                description="In the unit of the gateway's price table, per $__rate_interval.",
            ),
            timeseries(
                "Rate-limit refusals by team and reason",
                [
                    (
                        sum_rate("team, reason", "sarv_gateway_ratelimit_rejections_total", tk),
                        "{{team}} {{reason}}",
                    )
                ],
                "reqps",
            ),
            row("Keys"),
            timeseries(
                "Tokens/s by key",
                [
                    (sum_rate("team, key", "sarv_gateway_prompt_tokens_total", t), "prompt {{team}}/{{key}}"),
                    (
                        sum_rate("team, key", "sarv_gateway_completion_tokens_total", t),
                        "completion {{team}}/{{key}}",
                    ),
                ],
                "short",
            ),
            timeseries(
                "Requests/s by key",
                [(sum_rate("team, key", "sarv_gateway_requests_total", t), "{{team}}/{{key}}")],
                "reqps",
            ),
            timeseries(
                "Rate-limit refusals by key",
                [
                    (
                        sum_rate("key, reason", "sarv_gateway_ratelimit_rejections_total", tk),
                        "{{key}} {{reason}}",
                    )
                ],
                "reqps",
                width=24,
            ),
        ],
        links=[link_to("gateway", "Gateway")],
    )


DASHBOARDS: tuple[Callable[[], Dashboard], ...] = (fleet, replicas, gpu_nodes, capacity, gateway, tenants)


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
