"""The :class:`StateStore` protocol every backend implements, and the API-key record it stores."""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from controlplane.spec import DeploymentRecord, ReplicaRecord, RolloutRecord

__all__ = [
    "ApiKeyRecord",
    "AuditEntry",
    "EventRecord",
    "LevelLimits",
    "NodeRecord",
    "StateStore",
    "TeamRecord",
    "UsageRecord",
]


class ApiKeyRecord(BaseModel):
    """An API key as stored: only the sha256 of the secret, never the secret itself."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    key_hash: str = Field(pattern=r"^[0-9a-f]{64}$")
    """sha256 hex digest of the full key."""
    prefix: str = ""
    """First characters of the key (``sk-sarv-AbCd``), shown by ``llmctl keys list``."""
    models: list[str] = Field(default_factory=list)
    """Allowed model names; empty means all."""
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    daily_tokens: int | None = Field(default=None, ge=1)
    max_prompt_tokens: int | None = Field(default=None, ge=1)
    expires_at: float | None = None
    revoked: bool = False
    created_at: float = 0.0
    team: str | None = None
    """The team the key belongs to; None: no team (only the key's own limits apply)."""


class LevelLimits(BaseModel):
    """The limits of a team or the organisation (None: no limit of that kind)."""

    model_config = ConfigDict(extra="forbid")

    models: list[str] = Field(default_factory=list)
    """Allowed models; empty: all."""
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    daily_tokens: int | None = Field(default=None, ge=1)
    monthly_tokens: int | None = Field(default=None, ge=1)
    """Tokens per UTC calendar month."""
    max_prompt_tokens: int | None = Field(default=None, ge=1)


class TeamRecord(LevelLimits):
    """A team of keys and its limits."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    created_at: float = 0.0


class AuditEntry(BaseModel):
    """One administrative action: who did what, when, and how it ended."""

    model_config = ConfigDict(extra="forbid")

    at: float
    actor: str
    """``user@host`` for the CLI, or the API identity."""
    action: str
    """``keys.create``, ``teams.delete``, ``deploy`` …"""
    target: str = ""
    details: dict[str, str] = Field(default_factory=dict)
    outcome: str = "ok"
    """``ok`` or the error line."""


class EventRecord(BaseModel):
    """Something the controller or a command did, and why (like ``kubectl get events``).

    ``object`` names what the event is about: ``deployment/NAME``, ``replica/ID`` or ``node/NAME``;
    ``deployment`` is set whenever the event concerns one, so ``llmctl events NAME`` finds it.
    """

    model_config = ConfigDict(extra="forbid")

    at: float
    type: Literal["Normal", "Warning"] = "Normal"
    reason: str = Field(min_length=1, max_length=64)
    """CamelCase cause: ``Scaled``, ``Rescheduled``, ``Drained``, ``RolledBack``, ``NoRoom`` …"""
    message: str = ""
    """One line for people: ``scaled from 2 to 3 replicas: queue wait p90 0.41 s > 0.20 s``."""
    object: str = ""
    deployment: str | None = None
    source: str = "llmctl"
    """Who acted: ``controller``, ``llmctl`` (with the actor in ``message`` where it matters)."""


class NodeRecord(BaseModel):
    """What the control plane keeps about one fleet node beyond the inventory: whether it takes new
    replicas (``llmctl cordon|uncordon``). A node without a record is schedulable."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=253)
    schedulable: bool = True
    """False once cordoned: placement (deploy, scale, drain's replacements) leaves the node out."""
    reason: str = ""
    """Why it was cordoned (``drain``, the operator's note); empty when schedulable."""
    updated_at: float = 0.0


class UsageRecord(BaseModel):
    """What one key (in one team) used of one model in one UTC hour; stores add these up."""

    model_config = ConfigDict(extra="forbid")

    hour: int
    """Epoch seconds of the hour's start (a multiple of 3600)."""
    key: str
    """The key's name."""
    team: str = ""
    """"" for a key without a team."""
    model: str
    requests: int = 0
    """Client requests, each counted once however many replicas the gateway tried."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    """Requests answered with an error (4xx other than 429, and 5xx)."""
    rejected: int = 0
    """Requests refused by a rate limit or quota (429)."""
    cost: float = 0.0
    """At the operator's prices when the request was served (0 without prices)."""

    @property
    def ident(self) -> tuple[int, str, str, str]:
        return (self.hour, self.key, self.team, self.model)


@runtime_checkable
class StateStore(Protocol):
    """Desired state (deployments), observed state (replicas) and API keys.

    Every write bumps a monotonically increasing revision so that readers (gateways) can cheaply
    poll for change. Implementations are safe to share between threads of one process.
    """

    # deployments (desired)
    def put_deployment(self, record: DeploymentRecord) -> None: ...
    def get_deployment(self, name: str) -> DeploymentRecord | None: ...
    def list_deployments(self) -> list[DeploymentRecord]: ...
    def delete_deployment(self, name: str) -> bool: ...

    # replicas (observed)
    def put_replica(self, record: ReplicaRecord) -> None: ...
    def get_replica(self, replica_id: str) -> ReplicaRecord | None: ...
    def list_replicas(self, deployment: str | None = None) -> list[ReplicaRecord]: ...
    def delete_replica(self, replica_id: str) -> bool: ...

    # rollouts (one per deployment: the running one, or the last finished)
    def put_rollout(self, record: RolloutRecord) -> None: ...
    def get_rollout(self, deployment: str) -> RolloutRecord | None: ...
    def list_rollouts(self) -> list[RolloutRecord]: ...
    def delete_rollout(self, deployment: str) -> bool: ...

    # nodes (cordon state; a node without a record is schedulable)
    def put_node(self, record: NodeRecord) -> None: ...
    def get_node(self, name: str) -> NodeRecord | None: ...
    def list_nodes(self) -> list[NodeRecord]: ...

    # API keys
    def put_api_key(self, record: ApiKeyRecord) -> None: ...
    def get_api_key(self, key_hash: str) -> ApiKeyRecord | None: ...
    def get_api_key_by_name(self, name: str) -> ApiKeyRecord | None: ...
    def list_api_keys(self) -> list[ApiKeyRecord]: ...

    # engine keys: the secret each deployment's engines require, kept apart from the records
    # that ``llmctl status`` prints
    def put_engine_key(self, deployment: str, key: SecretStr) -> None: ...
    def get_engine_key(self, deployment: str) -> SecretStr | None: ...
    def delete_engine_key(self, deployment: str) -> bool: ...

    # teams
    def put_team(self, record: TeamRecord) -> None: ...
    def get_team(self, name: str) -> TeamRecord | None: ...
    def list_teams(self) -> list[TeamRecord]: ...
    def delete_team(self, name: str) -> bool: ...

    # audit trail (append-only: there is no update or delete)
    def append_audit(self, entry: AuditEntry) -> None: ...
    def list_audit(self, since: float = 0.0) -> list[AuditEntry]: ...

    # events (kept for a bounded history: the oldest are dropped past a few thousand)
    def append_event(self, event: EventRecord) -> None: ...
    def list_events(
        self, deployment: str | None = None, since: float = 0.0, limit: int = 1000
    ) -> list[EventRecord]:
        """Events at or after ``since``, oldest first, the newest ``limit`` of them."""
        ...

    # usage per key, team, model and hour (counters only grow; not a state change: no revision bump)
    def add_usage(self, rows: list[UsageRecord]) -> None:
        """Add each row's counts to the stored row of the same hour, key, team and model."""
        ...

    def list_usage(self, since: float = 0.0, until: float | None = None) -> list[UsageRecord]:
        """Rows of the hours that start in ``[since's hour, until)``, by hour, key, team, model."""
        ...

    # wake requests: a gateway holding requests of a deployment at zero asks the controller to wake it
    # (not a state change: no revision bump; the controller polls them between its passes)
    def request_wake(self, deployment: str, at: float) -> None:
        """Ask for ``deployment`` to be woken (the newest ask's time is kept)."""
        ...

    def list_wake_requests(self) -> dict[str, float]:
        """Deployment → time of the newest wake request not yet cleared."""
        ...

    def clear_wake_request(self, deployment: str) -> None: ...

    # change feed and lifecycle
    def revision(self) -> int: ...
    def ping(self) -> None:
        """Raise :class:`~controlplane.errors.StateError` when the backend is unreachable."""
        ...

    def close(self) -> None: ...
