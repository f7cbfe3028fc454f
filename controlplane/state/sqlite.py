"""The embedded state store: one SQLite file (WAL, mode 0600), safe across threads and processes."""

from __future__ import annotations

import os
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, SecretStr, ValidationError

from controlplane.errors import StateError
from controlplane.spec import DeploymentRecord, ReplicaRecord, RolloutRecord
from controlplane.state.base import (
    ApiKeyRecord,
    AuditEntry,
    EventRecord,
    NodeRecord,
    TeamRecord,
    UsageRecord,
)

__all__ = ["SCHEMA_VERSION", "SqliteStore"]

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)

SCHEMA_VERSION = 8
"""``PRAGMA user_version`` of the layout below; a file from a newer Sarv is refused, never rewritten."""

# Version n's statements take a file from version n - 1 to n. Append, never edit a released step.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
        "INSERT INTO meta (key, value) VALUES ('revision', 0)",
        "CREATE TABLE deployments (name TEXT PRIMARY KEY, body TEXT NOT NULL)",
        "CREATE TABLE replicas (id TEXT PRIMARY KEY, deployment TEXT NOT NULL, body TEXT NOT NULL)",
        "CREATE INDEX replicas_by_deployment ON replicas (deployment)",
        "CREATE TABLE api_keys (key_hash TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, body TEXT NOT NULL)",
    ),
    2: (
        "CREATE TABLE teams (name TEXT PRIMARY KEY, body TEXT NOT NULL)",
        "CREATE TABLE audit (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, body TEXT NOT NULL)",
        "CREATE INDEX audit_by_time ON audit (at)",
        "CREATE TRIGGER audit_no_update BEFORE UPDATE ON audit BEGIN "
        "SELECT RAISE(ABORT, 'the audit trail is append-only'); END",
        "CREATE TRIGGER audit_no_delete BEFORE DELETE ON audit BEGIN "
        "SELECT RAISE(ABORT, 'the audit trail is append-only'); END",
    ),
    3: (
        "CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, "
        "deployment TEXT, body TEXT NOT NULL)",
        "CREATE INDEX events_by_deployment ON events (deployment, at)",
    ),
    4: ("CREATE TABLE nodes (name TEXT PRIMARY KEY, body TEXT NOT NULL)",),
    5: (
        "CREATE TABLE usage (hour INTEGER NOT NULL, key TEXT NOT NULL, team TEXT NOT NULL, "
        "model TEXT NOT NULL, requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, "
        "completion_tokens INTEGER NOT NULL, errors INTEGER NOT NULL, rejected INTEGER NOT NULL, "
        "cost REAL NOT NULL, PRIMARY KEY (hour, key, team, model))",
    ),
    6: ("CREATE TABLE engine_keys (deployment TEXT PRIMARY KEY, secret TEXT NOT NULL)",),
    7: ("CREATE TABLE wake_requests (deployment TEXT PRIMARY KEY, at REAL NOT NULL)",),
    8: ("CREATE TABLE rollouts (deployment TEXT PRIMARY KEY, body TEXT NOT NULL)",),
}

EVENTS_KEPT = 5000
"""Events beyond the newest this many are dropped on write."""

_BUSY_TIMEOUT_MS = 30_000


class SqliteStore:
    """:class:`~controlplane.state.base.StateStore` on a SQLite file.

    One connection per store, serialised by a lock (threads); SQLite's file locks with a busy timeout
    and ``BEGIN IMMEDIATE`` writes (processes). Every write bumps ``meta.revision`` in its own
    transaction, so a reader that sees a revision also sees the write that made it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._conn = self._guard(self._open)

    # --- plumbing

    def _guard(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except sqlite3.Error as exc:
            raise StateError(f"state file {self.path}: {exc}", hint=_hint(exc)) from None
        except OSError as exc:  # creating the directory or the file
            raise StateError(
                f"state file {self.path}: {exc.strerror or exc}",
                hint="check the permissions of the file and its directory",
            ) from None

    def _open(self) -> sqlite3.Connection:
        _create_private(self.path)
        conn = sqlite3.connect(
            self.path, timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
            conn.execute("PRAGMA journal_mode = WAL")
            # NORMAL is durable in WAL mode except for the last transactions on power loss.
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")  # two processes opening a new file must not both migrate it
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise StateError(
                    f"state file {self.path} has schema version {version}, newer than this Sarv "
                    f"supports ({SCHEMA_VERSION}); upgrade Sarv or point state_url elsewhere"
                )
            for step in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[step]:
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {step}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction that also bumps the revision."""
        with self._lock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StateError(f"state file {self.path}: {exc}", hint=_hint(exc)) from None
            try:
                yield conn
                conn.execute("UPDATE meta SET value = value + 1 WHERE key = 'revision'")
                conn.execute("COMMIT")
            except _NoChange:
                conn.execute("ROLLBACK")
            except sqlite3.Error as exc:
                conn.execute("ROLLBACK")
                raise StateError(f"state file {self.path}: {exc}", hint=_hint(exc)) from None
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def _read(self, sql: str, params: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        with self._lock:
            return self._guard(lambda: self._conn.execute(sql, params).fetchall())

    def _load(self, model: type[_M], body: str) -> _M:
        try:
            return model.model_validate_json(body)
        except ValidationError as exc:
            raise StateError(
                f"state file {self.path}: a stored {model.__name__} no longer validates ({exc.error_count()} "
                "errors)",
                hint="it was written by another Sarv version; re-create the object",
            ) from None

    def _delete(self, sql: str, key: str) -> bool:
        with self._write() as conn:
            if conn.execute(sql, (key,)).rowcount == 0:
                raise _NoChange
            return True
        return False

    # --- deployments

    def put_deployment(self, record: DeploymentRecord) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT INTO deployments (name, body) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET body = excluded.body",
                (record.name, record.model_dump_json()),
            )

    def get_deployment(self, name: str) -> DeploymentRecord | None:
        rows = self._read("SELECT body FROM deployments WHERE name = ?", (name,))
        return self._load(DeploymentRecord, rows[0][0]) if rows else None

    def list_deployments(self) -> list[DeploymentRecord]:
        rows = self._read("SELECT body FROM deployments ORDER BY name")
        return [self._load(DeploymentRecord, r[0]) for r in rows]

    def delete_deployment(self, name: str) -> bool:
        return self._delete("DELETE FROM deployments WHERE name = ?", name)

    # --- replicas

    def put_replica(self, record: ReplicaRecord) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT INTO replicas (id, deployment, body) VALUES (?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET deployment = excluded.deployment, body = excluded.body",
                (record.id, record.deployment, record.model_dump_json()),
            )

    def get_replica(self, replica_id: str) -> ReplicaRecord | None:
        rows = self._read("SELECT body FROM replicas WHERE id = ?", (replica_id,))
        return self._load(ReplicaRecord, rows[0][0]) if rows else None

    def list_replicas(self, deployment: str | None = None) -> list[ReplicaRecord]:
        if deployment is None:
            rows = self._read("SELECT body FROM replicas ORDER BY id")
        else:
            rows = self._read("SELECT body FROM replicas WHERE deployment = ? ORDER BY id", (deployment,))
        return [self._load(ReplicaRecord, r[0]) for r in rows]

    def delete_replica(self, replica_id: str) -> bool:
        return self._delete("DELETE FROM replicas WHERE id = ?", replica_id)

    # --- API keys

    def put_api_key(self, record: ApiKeyRecord) -> None:
        """Store ``record``; a key with the same name but another hash is replaced (key rotation)."""
        with self._write() as conn:
            conn.execute(
                "DELETE FROM api_keys WHERE name = ? AND key_hash != ?", (record.name, record.key_hash)
            )
            conn.execute(
                "INSERT INTO api_keys (key_hash, name, body) VALUES (?, ?, ?) "
                "ON CONFLICT (key_hash) DO UPDATE SET name = excluded.name, body = excluded.body",
                (record.key_hash, record.name, record.model_dump_json()),
            )

    def get_api_key(self, key_hash: str) -> ApiKeyRecord | None:
        rows = self._read("SELECT body FROM api_keys WHERE key_hash = ?", (key_hash,))
        return self._load(ApiKeyRecord, rows[0][0]) if rows else None

    def get_api_key_by_name(self, name: str) -> ApiKeyRecord | None:
        rows = self._read("SELECT body FROM api_keys WHERE name = ?", (name,))
        return self._load(ApiKeyRecord, rows[0][0]) if rows else None

    def list_api_keys(self) -> list[ApiKeyRecord]:
        rows = self._read("SELECT body FROM api_keys ORDER BY name")
        return [self._load(ApiKeyRecord, r[0]) for r in rows]

    # --- engine keys

    def put_engine_key(self, deployment: str, key: SecretStr) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT INTO engine_keys (deployment, secret) VALUES (?, ?) "
                "ON CONFLICT (deployment) DO UPDATE SET secret = excluded.secret",
                (deployment, key.get_secret_value()),
            )

    def get_engine_key(self, deployment: str) -> SecretStr | None:
        rows = self._read("SELECT secret FROM engine_keys WHERE deployment = ?", (deployment,))
        return SecretStr(rows[0][0]) if rows else None

    def delete_engine_key(self, deployment: str) -> bool:
        return self._delete("DELETE FROM engine_keys WHERE deployment = ?", deployment)

    # --- rollouts

    def put_rollout(self, record: RolloutRecord) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT INTO rollouts (deployment, body) VALUES (?, ?) "
                "ON CONFLICT (deployment) DO UPDATE SET body = excluded.body",
                (record.deployment, record.model_dump_json()),
            )

    def get_rollout(self, deployment: str) -> RolloutRecord | None:
        rows = self._read("SELECT body FROM rollouts WHERE deployment = ?", (deployment,))
        return self._load(RolloutRecord, rows[0][0]) if rows else None

    def list_rollouts(self) -> list[RolloutRecord]:
        rows = self._read("SELECT body FROM rollouts ORDER BY deployment")
        return [self._load(RolloutRecord, r[0]) for r in rows]

    def delete_rollout(self, deployment: str) -> bool:
        return self._delete("DELETE FROM rollouts WHERE deployment = ?", deployment)

    # --- nodes

    def put_node(self, record: NodeRecord) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT INTO nodes (name, body) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET body = excluded.body",
                (record.name, record.model_dump_json()),
            )

    def get_node(self, name: str) -> NodeRecord | None:
        rows = self._read("SELECT body FROM nodes WHERE name = ?", (name,))
        return self._load(NodeRecord, rows[0][0]) if rows else None

    def list_nodes(self) -> list[NodeRecord]:
        rows = self._read("SELECT body FROM nodes ORDER BY name")
        return [self._load(NodeRecord, r[0]) for r in rows]

    # --- teams

    def put_team(self, record: TeamRecord) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT INTO teams (name, body) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET body = excluded.body",
                (record.name, record.model_dump_json()),
            )

    def get_team(self, name: str) -> TeamRecord | None:
        rows = self._read("SELECT body FROM teams WHERE name = ?", (name,))
        return self._load(TeamRecord, rows[0][0]) if rows else None

    def list_teams(self) -> list[TeamRecord]:
        rows = self._read("SELECT body FROM teams ORDER BY name")
        return [self._load(TeamRecord, r[0]) for r in rows]

    def delete_team(self, name: str) -> bool:
        return self._delete("DELETE FROM teams WHERE name = ?", name)

    # --- audit trail

    def append_audit(self, entry: AuditEntry) -> None:
        with self._lock:
            self._guard(
                lambda: self._conn.execute(
                    "INSERT INTO audit (at, body) VALUES (?, ?)", (entry.at, entry.model_dump_json())
                )
            )

    def list_audit(self, since: float = 0.0) -> list[AuditEntry]:
        with self._lock:
            rows = self._guard(
                lambda: self._conn.execute(
                    "SELECT body FROM audit WHERE at >= ? ORDER BY id", (since,)
                ).fetchall()
            )
        return [self._load(AuditEntry, r[0]) for r in rows]

    # --- events

    def append_event(self, event: EventRecord) -> None:
        # Not a state change: readers polling the revision need not wake for it.
        with self._lock:
            self._guard(lambda: self._append_event(event))

    def _append_event(self, event: EventRecord) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            cur = conn.execute(
                "INSERT INTO events (at, deployment, body) VALUES (?, ?, ?)",
                (event.at, event.deployment, event.model_dump_json()),
            )
            last = cur.lastrowid or 0
            if last % 100 == 0:
                conn.execute("DELETE FROM events WHERE id <= ?", (last - EVENTS_KEPT,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def list_events(
        self, deployment: str | None = None, since: float = 0.0, limit: int = 1000
    ) -> list[EventRecord]:
        # (? IS NULL OR …) keeps one static statement for both the filtered and the unfiltered list.
        sql = (
            "SELECT body FROM (SELECT id, body FROM events WHERE at >= ? AND (? IS NULL OR deployment = ?) "
            "ORDER BY id DESC LIMIT ?) ORDER BY id"
        )
        params = (since, deployment, deployment, limit)
        with self._lock:
            rows = self._guard(lambda: self._conn.execute(sql, params).fetchall())
        return [self._load(EventRecord, r[0]) for r in rows]

    # --- wake requests (a gateway holding requests of a deployment at zero asks the controller)

    def request_wake(self, deployment: str, at: float) -> None:
        # Not a state change: the controller polls these itself; gateways need not re-read replicas.
        sql = (
            "INSERT INTO wake_requests (deployment, at) VALUES (?, ?) "
            "ON CONFLICT (deployment) DO UPDATE SET at = excluded.at"
        )
        with self._lock:
            self._guard(lambda: self._conn.execute(sql, (deployment, at)))

    def list_wake_requests(self) -> dict[str, float]:
        rows = self._read("SELECT deployment, at FROM wake_requests")
        return {str(name): float(at) for name, at in rows}

    def clear_wake_request(self, deployment: str) -> None:
        sql = "DELETE FROM wake_requests WHERE deployment = ?"
        with self._lock:
            self._guard(lambda: self._conn.execute(sql, (deployment,)))

    # --- usage

    def add_usage(self, rows: list[UsageRecord]) -> None:
        # Not a state change: readers polling the revision need not wake for it.
        params = [
            (
                r.hour,
                r.key,
                r.team,
                r.model,
                r.requests,
                r.prompt_tokens,
                r.completion_tokens,
                r.errors,
                r.rejected,
                r.cost,
            )
            for r in rows
        ]
        if params:
            with self._lock:
                self._guard(lambda: self._add_usage(params))

    def _add_usage(self, params: Sequence[tuple[int | str | float, ...]]) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(
                "INSERT INTO usage (hour, key, team, model, requests, prompt_tokens, completion_tokens, "
                "errors, rejected, cost) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (hour, key, team, model) DO UPDATE SET "
                "requests = requests + excluded.requests, "
                "prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                "completion_tokens = completion_tokens + excluded.completion_tokens, "
                "errors = errors + excluded.errors, rejected = rejected + excluded.rejected, "
                "cost = cost + excluded.cost",
                params,
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def list_usage(self, since: float = 0.0, until: float | None = None) -> list[UsageRecord]:
        start = int(since // 3600) * 3600
        end = 1 << 62 if until is None else until
        sql = (
            "SELECT hour, key, team, model, requests, prompt_tokens, completion_tokens, errors, rejected, "
            "cost FROM usage WHERE hour >= ? AND hour < ? ORDER BY hour, key, team, model"
        )
        with self._lock:
            rows = self._guard(lambda: self._conn.execute(sql, (start, end)).fetchall())
        names = list(UsageRecord.model_fields)
        return [UsageRecord.model_validate(dict(zip(names, row, strict=True))) for row in rows]

    # --- change feed and lifecycle

    def revision(self) -> int:
        rows = self._read("SELECT value FROM meta WHERE key = 'revision'")
        return int(rows[0][0])

    def ping(self) -> None:
        self.revision()

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class _NoChange(Exception):
    """Raised inside a write transaction that changed nothing: roll back, keep the revision."""


def _create_private(path: Path) -> None:
    """Create the file (and its directory) readable by this user only; tighten an existing file."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # O_CREAT with 0600 before sqlite3 opens it: SQLite would create it with the umask's mode, and its
    # -wal/-shm files copy the database file's permissions.
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        # Do not open an existing file here, not even briefly: POSIX locks belong to the process, and
        # closing any descriptor of the file drops the SHARED lock that another SqliteStore of this
        # process holds on it. The next process to close its connection then believes it is the last
        # one, checkpoints and deletes the -wal and -shm files, and that other store keeps reading the
        # deleted copies: the same stale rows and revision for ever. (SQLite's own descriptors are
        # shared per file inside the process and never closed while a lock is held.)
        if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
            os.chmod(path, 0o600)


def _hint(exc: sqlite3.Error) -> str | None:
    text = str(exc)
    if "not a database" in text:
        return "the file is not a SQLite database; point state_url at another path"
    if "locked" in text or "busy" in text:
        return "another process holds a long write lock; retry"
    if "readonly" in text or "unable to open" in text:
        return "check the file's and its directory's permissions"
    return None
