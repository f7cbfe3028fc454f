"""The OpenAI-compatible gateway: auth, limits, validation, guardrails, routing, streaming proxy, metrics."""

from controlplane.gateway.app import GatewayApp
from controlplane.gateway.config import GatewayConfig, RoutingPolicy, load_gateway_config
from controlplane.gateway.metrics import GatewayMetrics
from controlplane.gateway.ratelimit import InProcessLimiter, KeyLimits, RateLimiter, RedisLimiter
from controlplane.gateway.routing import Router

__all__ = [
    "GatewayApp",
    "GatewayConfig",
    "GatewayMetrics",
    "InProcessLimiter",
    "KeyLimits",
    "RateLimiter",
    "RedisLimiter",
    "Router",
    "RoutingPolicy",
    "load_gateway_config",
]
