"""The OpenAI-compatible gateway, by the request's stages: admission, requests, guardrails, upstream."""

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
