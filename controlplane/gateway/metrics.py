"""The gateway's Prometheus series, on a registry owned by one app (several apps per process in tests)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

__all__ = ["GatewayMetrics"]

# Latency buckets from 1 ms to 2 min: TTFT of a cached prompt is a few ms, a long generation minutes.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_HOLD = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class GatewayMetrics:
    """Series names are a contract with the dashboards (dashboards/src); do not rename them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "sarv_gateway_requests",
            "Requests by model, key name, team and status",
            ["model", "key", "team", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "sarv_gateway_ttft_seconds",
            "Time to first byte of the answer",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "sarv_gateway_itl_seconds", "Time between streamed chunks", ["model"], buckets=_ITL, registry=r
        )
        self.e2e = Histogram(
            "sarv_gateway_e2e_seconds", "End-to-end request latency", ["model"], buckets=_LATENCY, registry=r
        )
        self.queue = Histogram(
            "sarv_gateway_queue_seconds",
            "Time queued in the gateway",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        # ``team`` is "" for a key without a team.
        self.prompt_tokens = Counter(
            "sarv_gateway_prompt_tokens", "Prompt tokens", ["model", "key", "team"], registry=r
        )
        self.completion_tokens = Counter(
            "sarv_gateway_completion_tokens", "Completion tokens", ["model", "key", "team"], registry=r
        )
        self.cost = Counter(
            "sarv_gateway_cost",
            "Cost of the tokens used, at the operator's prices per model (gateway config)",
            ["model", "team", "key"],
            registry=r,
        )
        self.ratelimit_rejections = Counter(
            "sarv_gateway_ratelimit_rejections",
            "Requests refused by rate limits; reason is the limit (rpm, tpm, daily, monthly), prefixed with "
            "team_ or organisation_ when that level refused",
            ["key", "team", "reason"],
            registry=r,
        )
        self.validation_rejections = Counter(
            "sarv_gateway_validation_rejections", "Requests refused by validation", ["reason"], registry=r
        )
        self.routing_decisions = Counter(
            "sarv_gateway_routing_decisions", "Replica picks", ["policy", "replica"], registry=r
        )
        self.retries = Counter("sarv_gateway_retries", "Requests retried on another replica", registry=r)
        self.upstream_errors = Counter(
            "sarv_gateway_upstream_errors", "Failed upstream calls", ["replica"], registry=r
        )
        self.replicas = Gauge("sarv_gateway_replicas", "Known replicas by state", ["state"], registry=r)
        self.tokenizer_exact = Gauge(
            "sarv_gateway_tokenizer_exact",
            "1: prompt lengths of the model are counted with its tokenizer; 0: a byte-based lower bound",
            ["model"],
            registry=r,
        )
        self.limiter_errors = Counter(
            "sarv_gateway_ratelimit_backend_errors",
            "Rate-limiter backend unreachable, by what the gateway did (admitted = fail open)",
            ["action"],
            registry=r,
        )
        self.guardrail_actions = Counter(
            "sarv_gateway_guardrail_actions",
            "Guardrail refusals and redactions",
            ["hook", "action"],
            registry=r,
        )

        self.held = Gauge(
            "sarv_gateway_held_requests",
            "Requests held now for a model scaled to zero, while it wakes",
            ["model"],
            registry=r,
        )
        self.held_total = Counter(
            "sarv_gateway_held",
            "Requests held for a model scaled to zero, by outcome: served, timeout, full (503 at once), gone",
            ["model", "outcome"],
            registry=r,
        )
        self.hold_seconds = Histogram(
            "sarv_gateway_hold_seconds",
            "Time a request was held while its model woke (served or not)",
            ["model"],
            buckets=_HOLD,
            registry=r,
        )

        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """``metric.labels(*labels)``, memoised: the hot path asks for the same few series per request,
        and ``labels()`` validates and takes a lock on every call."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
