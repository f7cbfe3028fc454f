"""The Redis state store, standalone or Cluster: pydantic JSON in hashes, writes as atomic Lua scripts.

Every key carries the same hash tag (``{sarv:}…``), so all state lives in one Cluster slot: each write
updates a record and the revision counter in one atomic script, in Cluster as in standalone. The whole
state is small (deployments, replicas, keys), so one slot is no capacity limit.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, SecretStr, ValidationError

from controlplane.errors import ConfigError, StateError
from controlplane.spec import DeploymentRecord, ReplicaRecord, RolloutRecord
from controlplane.state.base import (
    ApiKeyRecord,
    AuditEntry,
    EventRecord,
    NodeRecord,
    TeamRecord,
    UsageRecord,
)
from controlplane.state.clients import RedisEndpoint, redis_error, sync_client

if TYPE_CHECKING:
    from redis.commands.core import Script

__all__ = ["RedisStore"]

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)

_TIMEOUT_S = 5.0

EVENTS_KEPT = 5000
"""The events stream is trimmed to about this many entries."""

# KEYS[1] hash, KEYS[2] revision; ARGV[1] field, ARGV[2] JSON. Returns the new revision.
_PUT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return redis.call('INCR', KEYS[2])
"""

# KEYS[1] hash, KEYS[2] revision; ARGV[1] field. Returns 1 when something was deleted.
_DELETE = """
local n = redis.call('HDEL', KEYS[1], ARGV[1])
if n > 0 then redis.call('INCR', KEYS[2]) end
return n
"""

# KEYS[1] keys by hash, KEYS[2] hash by name, KEYS[3] revision; ARGV[1] hash, ARGV[2] name, ARGV[3] JSON.
# A name points at one key: storing a new hash under a known name drops the old key (rotation), and
# storing a known hash under a new name drops the old name.
_PUT_KEY = """
local old_hash = redis.call('HGET', KEYS[2], ARGV[2])
if old_hash and old_hash ~= ARGV[1] then redis.call('HDEL', KEYS[1], old_hash) end
local previous = redis.call('HGET', KEYS[1], ARGV[1])
if previous then
  local old_name = cjson.decode(previous)['name']
  if old_name ~= ARGV[2] then redis.call('HDEL', KEYS[2], old_name) end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[1])
return redis.call('INCR', KEYS[3])
"""

# KEYS[1] the hour's usage hash, KEYS[2] the sorted set of hours; ARGV[1] the hour, then field/amount pairs
# (a field ending in "cost" is a float). One script per hour bucket: a flush is applied whole or not at all.
_ADD_USAGE = """
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
for i = 2, #ARGV, 2 do
  local f = ARGV[i]
  if string.sub(f, -4) == 'cost' then
    redis.call('HINCRBYFLOAT', KEYS[1], f, ARGV[i + 1])
  else
    redis.call('HINCRBY', KEYS[1], f, ARGV[i + 1])
  end
end
return 1
"""

_USAGE_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "errors", "rejected", "cost")


class RedisStore:
    """:class:`~controlplane.state.base.StateStore` on Redis or Redis Cluster (redis-py's clients).

    The client is created on first use, so constructing a store never touches the network; every
    failure surfaces as :class:`StateError` naming the URL without its password.
    """

    def __init__(self, endpoint: RedisEndpoint, *, prefix: str = "sarv:") -> None:
        if "{" in prefix or "}" in prefix:
            raise ConfigError(
                f"state_prefix {prefix!r} must not contain braces (they form the Cluster hash tag)"
            )
        self._endpoint = endpoint
        self._shown = endpoint.shown
        tag = "{" + prefix + "}"
        self._deployments = tag + "deployments"
        self._replicas = tag + "replicas"
        self._keys = tag + "apikeys"
        self._key_names = tag + "apikey-names"
        self._engine_keys = tag + "engine-keys"
        self._revision = tag + "revision"
        self._teams = tag + "teams"
        self._nodes = tag + "nodes"
        self._rollouts = tag + "rollouts"
        self._audit = tag + "audit"
        self._events = tag + "events"
        self._usage = tag + "usage:"
        self._usage_hours = tag + "usage-hours"
        self._wakes = tag + "wake-requests"
        self._lock = threading.Lock()
        self._client: Any = None
        self._scripts: dict[str, Script] = {}

    # --- plumbing

    def _call(self, fn: Callable[[Any], _T]) -> _T:
        from redis.exceptions import RedisClusterException, RedisError

        try:
            with self._lock:
                if self._client is None:
                    self._client = sync_client(self._endpoint, timeout_s=_TIMEOUT_S)
                    self._scripts = {
                        name: self._client.register_script(src)
                        for name, src in (
                            ("put", _PUT),
                            ("delete", _DELETE),
                            ("put_key", _PUT_KEY),
                            ("add_usage", _ADD_USAGE),
                        )
                    }
                client = self._client
            return fn(client)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise redis_error(self._endpoint, exc) from None

    def _script(self, name: str, keys: list[str], args: list[str]) -> Any:
        return self._call(lambda _client: self._scripts[name](keys=keys, args=args))

    def _load(self, model: type[_M], body: str) -> _M:
        try:
            return model.model_validate_json(body)
        except ValidationError as exc:
            raise StateError(
                f"state store {self._shown}: a stored {model.__name__} no longer validates "
                f"({exc.error_count()} errors)",
                hint="it was written by another Sarv version; re-create the object",
            ) from None

    def _get(self, model: type[_M], key: str, field: str) -> _M | None:
        body = self._call(lambda c: c.hget(key, field))
        return None if body is None else self._load(model, body)

    def _values(self, model: type[_M], key: str) -> list[tuple[str, _M]]:
        items: dict[str, str] = self._call(lambda c: c.hgetall(key))
        return [(k, self._load(model, v)) for k, v in sorted(items.items())]

    # --- deployments

    def put_deployment(self, record: DeploymentRecord) -> None:
        self._script("put", [self._deployments, self._revision], [record.name, record.model_dump_json()])

    def get_deployment(self, name: str) -> DeploymentRecord | None:
        return self._get(DeploymentRecord, self._deployments, name)

    def list_deployments(self) -> list[DeploymentRecord]:
        return [r for _, r in self._values(DeploymentRecord, self._deployments)]

    def delete_deployment(self, name: str) -> bool:
        return bool(self._script("delete", [self._deployments, self._revision], [name]))

    # --- replicas

    def put_replica(self, record: ReplicaRecord) -> None:
        self._script("put", [self._replicas, self._revision], [record.id, record.model_dump_json()])

    def get_replica(self, replica_id: str) -> ReplicaRecord | None:
        return self._get(ReplicaRecord, self._replicas, replica_id)

    def list_replicas(self, deployment: str | None = None) -> list[ReplicaRecord]:
        records = [r for _, r in self._values(ReplicaRecord, self._replicas)]
        return records if deployment is None else [r for r in records if r.deployment == deployment]

    def delete_replica(self, replica_id: str) -> bool:
        return bool(self._script("delete", [self._replicas, self._revision], [replica_id]))

    # --- API keys

    def put_api_key(self, record: ApiKeyRecord) -> None:
        """Store ``record``; a key with the same name but another hash is replaced (key rotation)."""
        self._script(
            "put_key",
            [self._keys, self._key_names, self._revision],
            [record.key_hash, record.name, record.model_dump_json()],
        )

    def get_api_key(self, key_hash: str) -> ApiKeyRecord | None:
        return self._get(ApiKeyRecord, self._keys, key_hash)

    def get_api_key_by_name(self, name: str) -> ApiKeyRecord | None:
        key_hash = self._call(lambda c: c.hget(self._key_names, name))
        return None if key_hash is None else self.get_api_key(key_hash)

    def list_api_keys(self) -> list[ApiKeyRecord]:
        return sorted((r for _, r in self._values(ApiKeyRecord, self._keys)), key=lambda r: r.name)

    # --- engine keys

    def put_engine_key(self, deployment: str, key: SecretStr) -> None:
        self._script("put", [self._engine_keys, self._revision], [deployment, key.get_secret_value()])

    def get_engine_key(self, deployment: str) -> SecretStr | None:
        value = self._call(lambda c: c.hget(self._engine_keys, deployment))
        return None if value is None else SecretStr(value)

    def delete_engine_key(self, deployment: str) -> bool:
        return bool(self._script("delete", [self._engine_keys, self._revision], [deployment]))

    # --- rollouts

    def put_rollout(self, record: RolloutRecord) -> None:
        self._script("put", [self._rollouts, self._revision], [record.deployment, record.model_dump_json()])

    def get_rollout(self, deployment: str) -> RolloutRecord | None:
        return self._get(RolloutRecord, self._rollouts, deployment)

    def list_rollouts(self) -> list[RolloutRecord]:
        return [r for _, r in self._values(RolloutRecord, self._rollouts)]

    def delete_rollout(self, deployment: str) -> bool:
        return bool(self._script("delete", [self._rollouts, self._revision], [deployment]))

    # --- nodes

    def put_node(self, record: NodeRecord) -> None:
        self._script("put", [self._nodes, self._revision], [record.name, record.model_dump_json()])

    def get_node(self, name: str) -> NodeRecord | None:
        return self._get(NodeRecord, self._nodes, name)

    def list_nodes(self) -> list[NodeRecord]:
        return [r for _, r in self._values(NodeRecord, self._nodes)]

    # --- teams

    def put_team(self, record: TeamRecord) -> None:
        self._script("put", [self._teams, self._revision], [record.name, record.model_dump_json()])

    def get_team(self, name: str) -> TeamRecord | None:
        return self._get(TeamRecord, self._teams, name)

    def list_teams(self) -> list[TeamRecord]:
        return [r for _, r in self._values(TeamRecord, self._teams)]

    def delete_team(self, name: str) -> bool:
        return bool(self._script("delete", [self._teams, self._revision], [name]))

    # --- audit trail: a Redis stream, appended to and never trimmed

    def append_audit(self, entry: AuditEntry) -> None:
        self._call(lambda c: c.xadd(self._audit, {"body": entry.model_dump_json()}))

    def list_audit(self, since: float = 0.0) -> list[AuditEntry]:
        # Stream ids are milliseconds of the server's clock; filter on the entry's own time as well.
        start = f"{max(0, int(since * 1000) - 60_000)}-0"
        items: list[tuple[Any, dict[Any, Any]]] = self._call(lambda c: c.xrange(self._audit, min=start))
        entries = [self._load(AuditEntry, str(fields["body"])) for _, fields in items]
        return [e for e in entries if e.at >= since]

    # --- events: a Redis stream trimmed to about the newest EVENTS_KEPT

    def append_event(self, event: EventRecord) -> None:
        self._call(
            lambda c: c.xadd(
                self._events, {"body": event.model_dump_json()}, maxlen=EVENTS_KEPT, approximate=True
            )
        )

    def list_events(
        self, deployment: str | None = None, since: float = 0.0, limit: int = 1000
    ) -> list[EventRecord]:
        start = f"{max(0, int(since * 1000) - 60_000)}-0"
        items: list[tuple[Any, dict[Any, Any]]] = self._call(lambda c: c.xrange(self._events, min=start))
        events = [self._load(EventRecord, str(fields["body"])) for _, fields in items]
        kept = [e for e in events if e.at >= since and (deployment is None or e.deployment == deployment)]
        return kept[-limit:] if limit > 0 else []

    # --- usage: one hash per hour, HINCRBY on fields named by (key, team, model) and the counter

    def add_usage(self, rows: list[UsageRecord]) -> None:
        by_hour: dict[int, list[str]] = {}
        for r in rows:
            who = json.dumps([r.key, r.team, r.model], separators=(",", ":"))
            args = by_hour.setdefault(r.hour, [str(r.hour)])
            for name in _USAGE_COUNTS:
                value = getattr(r, name)
                if value:
                    args += [f"{who}{name}", repr(value) if name == "cost" else str(value)]
        for hour, args in sorted(by_hour.items()):
            self._script("add_usage", [f"{self._usage}{hour}", self._usage_hours], args)

    def list_usage(self, since: float = 0.0, until: float | None = None) -> list[UsageRecord]:
        start = int(since // 3600) * 3600
        end = "+inf" if until is None else f"({until}"
        hours: list[str] = self._call(lambda c: c.zrangebyscore(self._usage_hours, start, end))
        names = [f"{self._usage}{hour}" for hour in sorted(hours, key=int)]
        out: list[UsageRecord] = []
        for hour, name in zip(sorted(hours, key=int), names, strict=True):
            fields: dict[str, str] = self._call(partial(_hgetall, name))
            rows: dict[str, dict[str, float | int]] = {}
            for field, value in fields.items():
                who, _, what = field.rpartition("]")
                rows.setdefault(who + "]", {})[what] = float(value) if what == "cost" else int(value)
            for who, counts in rows.items():
                key, team, model = json.loads(who)
                out.append(UsageRecord(hour=int(hour), key=key, team=team, model=model, **counts))
        return sorted(out, key=lambda r: r.ident)

    # --- wake requests: one hash, deployment → time of the newest ask (no revision bump)

    def request_wake(self, deployment: str, at: float) -> None:
        self._call(lambda c: c.hset(self._wakes, deployment, repr(at)))

    def list_wake_requests(self) -> dict[str, float]:
        fields: dict[str, str] = self._call(partial(_hgetall, self._wakes))
        return {name: float(at) for name, at in fields.items()}

    def clear_wake_request(self, deployment: str) -> None:
        self._call(lambda c: c.hdel(self._wakes, deployment))

    # --- change feed and lifecycle

    def revision(self) -> int:
        value = self._call(lambda c: c.get(self._revision))
        return int(value or 0)

    def ping(self) -> None:
        self._call(lambda c: c.ping())

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _hgetall(name: str, client: Any) -> dict[str, str]:
    return dict(client.hgetall(name))
