"""The gateway's configuration: request caps, queues, routing weights, the organisation's limits, prices,
usage accounting, the access log and guardrails."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from controlplane.errors import ConfigError, describe_validation_error
from controlplane.state.base import LevelLimits

__all__ = [
    "AccessLogConfig",
    "GatewayConfig",
    "GuardrailConfig",
    "HoldConfig",
    "LimitsConfig",
    "ModelOverrides",
    "OrganisationLimits",
    "RoutingConfig",
    "RoutingPolicy",
    "load_gateway_config",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RoutingPolicy(StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"
    PREFIX_LOAD = "prefix+load"


class LimitsConfig(_Model):
    """Caps checked before any replica sees a request (OWASP LLM10, past vLLM CVEs)."""

    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024, le=1 << 30)
    """Request bodies above this are answered 413 without being read further."""
    max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=1 << 20)
    """Total size of all request headers; above it the answer is 431."""
    max_tokens_cap: int = Field(default=32768, ge=1)
    """Largest accepted ``max_tokens`` / ``max_completion_tokens``."""
    default_max_tokens: int = Field(default=256, ge=1)
    """Tokens reserved against the key's TPM when a request gives no ``max_tokens``."""
    max_n: int = Field(default=16, ge=1)
    max_best_of: int = Field(default=16, ge=1)
    max_logprobs: int = Field(default=20, ge=0)
    max_stop_sequences: int = Field(default=8, ge=0)
    max_prompt_items: int = Field(default=256, ge=1)
    """Largest batch of prompts (completions) or inputs (embeddings), and messages per chat."""
    default_max_context: int = Field(default=8192, ge=16)
    """Context length assumed when neither a replica nor an override says it."""
    max_bytes_per_token: int = Field(default=8, ge=1)
    """Without a tokenizer the prompt's tokens are bounded below by bytes ÷ this: a prompt is refused only
    when it cannot possibly fit, and the replica catches the rest."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """Time allowed from a connection's opening (or a further request's first byte) to the end of the
    request's headers: a client that trickles its headers, or connects and says nothing, gets 408 and is
    disconnected (nginx's client_header_timeout)."""
    body_timeout_s: float = Field(default=30.0, gt=0)
    """Time allowed for a client to send its whole body (slow clients get 408)."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Upper bound on one request end to end, upstream included (504 when exceeded)."""
    connect_timeout_s: float = Field(default=3.0, gt=0)
    dead_peer_timeout_s: float = Field(default=10.0, ge=1, le=600)
    """How long data sent to a replica may stay unacknowledged (TCP_USER_TIMEOUT), and about how long an
    idle pooled connection's keepalive probes may go unanswered, before the connection is given up: a
    replica whose host vanished without a reset (powered off, cut off) then fails the request over to
    another replica instead of holding it until ``request_timeout_s``. A live but busy replica's kernel
    still acknowledges, so a long prefill is never cut by it."""
    max_outstanding_per_replica: int = Field(default=256, ge=1)
    """Requests in flight per unit of replica capacity before new ones queue in the gateway."""
    max_queue_per_model: int = Field(default=1024, ge=0)
    """Requests waiting per model; beyond it the answer is 503 with Retry-After."""
    queue_timeout_s: float = Field(default=30.0, gt=0)
    retry_after_s: int = Field(default=1, ge=1)


class RoutingConfig(_Model):
    """Routing policy and scorer weights (llm-d's defaults: queue 2, KV 2, prefix 3)."""

    policy: RoutingPolicy = RoutingPolicy.PREFIX_LOAD
    queue_weight: float = Field(default=2.0, ge=0)
    kv_weight: float = Field(default=2.0, ge=0)
    prefix_weight: float = Field(default=3.0, ge=0)
    block_tokens: int = Field(default=16, ge=1)
    """Prefix block size in tokens (tokenizer at hand) …"""
    block_bytes: int = Field(default=64, ge=4)
    """… or in bytes of prompt text (no tokenizer)."""
    max_blocks: int = Field(default=256, ge=1)
    lru_blocks_per_replica: int = Field(default=31250, ge=16)
    saturation_queue: float = Field(default=5.0, gt=0)
    """A replica with waiting/this ≥ 1 or KV/saturation_kv ≥ 1 is dropped from affinity candidates."""
    saturation_kv: float = Field(default=0.8, gt=0, le=1)
    load_guard_spread: float = Field(default=16.0, gt=0)
    """AIBrix's guard: when busiest − idlest outstanding (per capacity) exceeds this, pick least-loaded."""
    scrape_interval_s: float = Field(default=0.25, gt=0)
    metrics_stale_s: float = Field(default=1.0, gt=0)
    discovery_interval_s: float = Field(default=0.5, gt=0)
    max_retries: int = Field(default=2, ge=0)
    eject_after_failures: int = Field(default=3, ge=1)
    eject_s: float = Field(default=10.0, gt=0)
    """First ejection period; it doubles for a replica that fails again right after (up to 8×)."""


class HoldConfig(_Model):
    """Requests for a model scaled to zero (its deployment's ``scale_to_zero``): held while the
    controller wakes a replica, then served; see gateway/hold.py."""

    max_held_per_model: int = Field(default=256, ge=0, le=100_000)
    """Requests held per model at once; beyond it the answer is 503 with Retry-After (0: none held)."""
    hold_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    """Longest a request is held; then 503 with Retry-After. A cold start must fit in it; a wake from
    sleep mode takes seconds."""
    retry_after_s: int = Field(default=5, ge=1, le=3600)
    """The Retry-After of those 503s."""
    wake_every_s: float = Field(default=1.0, gt=0, le=60)
    """While requests are held, the wake request is written again this often (a controller that took
    over, or restarted, still sees it)."""


class GuardrailConfig(_Model):
    """Built-in guardrails, all off by default."""

    deny_patterns: list[str] = Field(default_factory=list)
    """Regular expressions; a matching prompt is refused with 400 ``content_policy_violation``."""
    deny_output_patterns: list[str] = Field(default_factory=list)
    """Regular expressions masked with ``[blocked]`` in responses, streamed ones included."""
    redact_pii_input: bool = False
    redact_pii_output: bool = False
    moderation_model: str | None = None
    """A model served by Sarv (e.g. a Llama Guard replica) asked about each prompt; "unsafe…" refuses it."""
    moderation_timeout_s: float = Field(default=10.0, gt=0)
    moderation_fail_open: bool = False
    """When the moderation model cannot answer: admit (True) or refuse with 503 (False, the default)."""

    @property
    def output_enabled(self) -> bool:
        return bool(self.deny_output_patterns) or self.redact_pii_output


class ModelOverrides(_Model):
    """Per-model knowledge the replicas do not advertise."""

    max_context: int | None = Field(default=None, ge=16)
    tokenizer: Path | None = None
    """A ``tokenizer.json`` (Hugging Face tokenizers) used to count prompt tokens and cut prefix blocks."""
    prompt_price_per_1k: float | None = Field(default=None, ge=0)
    """The operator's price of 1,000 prompt tokens (any currency); with it, usage and
    ``sarv_gateway_cost`` show each request's cost."""
    completion_price_per_1k: float | None = Field(default=None, ge=0)


class OrganisationLimits(LevelLimits):
    """Limits every request counts against, whichever its key and team (a team's limits, the same
    fields). Every gateway of one state store must have the same."""


class AccessLogConfig(_Model):
    """One JSON line per proxied request (no secrets; no prompt or answer unless ``include_content``)."""

    enabled: bool = False
    path: Path | None = None
    """A file to append to (created 0600); None: standard error."""
    include_content: bool = False
    """Also log the request body (prompts, messages) and the answer as sent (up to 1 MiB; a stream's SSE
    events). Off by default: both may hold personal data."""
    flush_interval_s: float = Field(default=1.0, gt=0, le=60)
    """Lines are written in batches at this interval (and at shutdown), not one write per request."""


class GatewayConfig(_Model):
    """Everything the gateway app needs besides its injected store, limiter, client and clock."""

    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    guardrails: GuardrailConfig = Field(default_factory=GuardrailConfig)
    models: dict[str, ModelOverrides] = Field(default_factory=dict)
    organisation: OrganisationLimits = Field(default_factory=OrganisationLimits)
    access_log: AccessLogConfig = Field(default_factory=AccessLogConfig)
    hold: HoldConfig = Field(default_factory=HoldConfig)
    usage_flush_interval_s: float = Field(default=5.0, gt=0, le=300)
    """Usage counts are added to the state store in batches at this interval and at shutdown; a gateway
    that is killed (not stopped) loses at most this much of its usage record."""
    model_cache: Path | None = None
    """Model cache on this host (``llmctl gateway`` sets it from the settings): each served model's
    tokenizer is loaded from the verified weights its replicas run, so prompt lengths are exact without a
    ``models.<name>.tokenizer``; None, or weights not in this cache: the byte bound."""
    key_cache_ttl_s: float = Field(default=5.0, ge=0)
    """How long a key (and team) lookup is trusted; a revoked key or a changed team takes effect within
    this time."""
    key_cache_size: int = Field(default=10000, ge=1)

    @model_validator(mode="after")
    def _caps(self) -> GatewayConfig:
        if self.limits.default_max_tokens > self.limits.max_tokens_cap:
            raise ValueError("limits.default_max_tokens cannot exceed limits.max_tokens_cap")
        return self


def load_gateway_config(path: Path | None) -> GatewayConfig:
    """The config from a YAML file (``None``: defaults), with a one-line error naming the bad fields."""
    if path is None:
        return GatewayConfig()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read gateway config {path}: {exc}") from None
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, what=f"gateway config {path}")) from None
