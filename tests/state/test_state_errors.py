"""State URLs, credentials, TLS, unreachable servers, SQLite files: one-line errors, secrets never shown."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fixtures.common import free_port, need_binary
from fixtures.redis import RedisServer
from state.records import ACL_PASSWORD, ACL_USER, api_key, deployment

from controlplane.errors import ConfigError, StateError
from controlplane.settings import Settings
from controlplane.state import open_store, redact_url
from controlplane.state.sqlite import SCHEMA_VERSION
from controlplane.state.url import RedisTarget, SqliteTarget, parse_state_url

SECRET = "hunter2-Very-Secret"


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("", "no scheme"),
        ("state.db", "no scheme"),
        ("postgres://u:" + SECRET + "@h/db", "unsupported scheme"),
        ("sqlite://relative.db", "three slashes"),
        ("sqlite:///", "three slashes"),
        ("sqlite:///:memory:", "file path"),
        ("redis://", "missing host"),
        ("redis://:" + SECRET + "@127.0.0.1:notaport/0", "port"),
        ("redis://127.0.0.1:70000/0", "port"),
        ("redis://127.0.0.1:6379/zero", "database"),
        ("redis://a:1,b:2/0", "redis+cluster"),
        ("redis+cluster://127.0.0.1:7000/3", "database 0"),
        ("redis://127.0.0.1:6379/0?ssl_cert_reqs=none", "query options"),
    ],
)
def test_bad_urls_are_config_errors(url: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(url)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message
    assert SECRET not in message


def test_redact_url() -> None:
    assert redact_url(f"redis://user:{SECRET}@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url(f"redis+cluster://:{SECRET}@a:1,b:2") == "redis+cluster://:***@a:1,b:2"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert redact_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def test_bad_prefix_and_missing_tls_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="braces"):
        open_store("redis://127.0.0.1:6379/0", Settings(state_prefix="{x}"))
    with pytest.raises(ConfigError, match="redis_tls_ca"):
        open_store("rediss://127.0.0.1:6379/0", Settings(redis_tls_ca=tmp_path / "missing.pem"))


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_unreachable_server_names_url_without_password(scheme: str) -> None:
    port = free_port()  # nothing listens here
    url = f"{scheme}://sarv:{SECRET}@127.0.0.1:{port}" + ("/0" if scheme == "redis" else "")
    store = open_store(url)  # opening does not touch the network
    with pytest.raises(StateError) as info:
        store.ping()
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message
    assert "sarv:***@" in message
    assert SECRET not in message
    assert "\n" not in message
    assert info.value.exit_code == 5
    store.close()


@pytest.mark.redis
def test_acl_credentials_from_url_or_settings(acl_redis: int) -> None:
    base = f"127.0.0.1:{acl_redis}/0"
    from_url = open_store(f"redis://{ACL_USER}:{ACL_PASSWORD}@{base}", Settings(state_prefix="acl-a:"))
    from_url.put_deployment(deployment("one"))
    from_settings = open_store(
        f"redis://{base}",
        Settings(state_prefix="acl-a:", redis_username=ACL_USER, redis_password=ACL_PASSWORD),
    )
    assert from_settings.get_deployment("one") == deployment("one")
    anonymous = open_store(f"redis://{base}", Settings(state_prefix="acl-a:"))
    with pytest.raises(StateError):
        anonymous.ping()
    for store in (from_url, from_settings, anonymous):
        store.close()


@pytest.mark.redis
def test_wrong_password_is_state_error_without_the_password(acl_redis: int) -> None:
    wrong = "not-" + ACL_PASSWORD
    store = open_store(f"redis://{ACL_USER}:{wrong}@127.0.0.1:{acl_redis}/0")
    with pytest.raises(StateError) as info:
        store.get_deployment("x")
    message = str(info.value)
    assert wrong not in message
    assert ACL_PASSWORD not in message
    assert f"{ACL_USER}:***@127.0.0.1:{acl_redis}" in message
    assert "redis_password" in message  # the hint says what to check
    store.close()


@pytest.mark.redis
def test_database_number_and_prefix_isolate(redis_server: RedisServer, redis_url: str) -> None:
    db0 = open_store(f"redis://127.0.0.1:{redis_server.port}/0", Settings(state_prefix="iso:"))
    db1 = open_store(f"redis://127.0.0.1:{redis_server.port}/1", Settings(state_prefix="iso:"))
    other = open_store(f"redis://127.0.0.1:{redis_server.port}/0", Settings(state_prefix="other:"))
    db0.put_api_key(api_key("k", "a"))
    assert db1.get_api_key_by_name("k") is None
    assert other.get_api_key_by_name("k") is None
    assert (db0.revision(), db1.revision(), other.revision()) == (1, 0, 0)
    for store in (db0, db1, other):
        store.close()


@pytest.mark.redis
def test_rediss_with_ca_from_settings(tls_redis: tuple[int, Path], tmp_path: Path) -> None:
    port, ca = tls_redis
    store = open_store(f"rediss://127.0.0.1:{port}/0", Settings(redis_tls_ca=ca, state_prefix="tls:"))
    store.put_deployment(deployment("secure"))
    assert store.get_deployment("secure") == deployment("secure")
    store.close()
    # Another CA does not verify the server: the connection is refused, as a StateError.
    other = tmp_path / "other-ca.crt"
    subprocess.run(
        [need_binary("openssl"), "req", "-x509", "-new", "-nodes", "-newkey", "rsa:2048", "-keyout",
         str(tmp_path / "k"), "-out", str(other), "-days", "1", "-subj", "/CN=other"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    untrusted = open_store(f"rediss://127.0.0.1:{port}/0", Settings(redis_tls_ca=other, state_prefix="tls:"))
    with pytest.raises(StateError, match="certificate"):
        untrusted.ping()
    untrusted.close()
    # Plain redis:// against the TLS port fails too, without hanging.
    plain = open_store(f"redis://127.0.0.1:{port}/0")
    with pytest.raises(StateError):
        plain.ping()
    plain.close()


# --- SQLite file


def test_sqlite_file_and_wal_are_private(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "state.db"
    store = open_store(f"sqlite:///{path}")
    store.put_deployment(deployment("a"))
    for p in path.parent.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_sqlite_existing_world_readable_file_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.touch()
    path.chmod(0o644)
    open_store(f"sqlite:///{path}").close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


_WRITER = """
import sys
from pathlib import Path
from controlplane.state.sqlite import SqliteStore
from state.records import deployment
store = SqliteStore(Path(sys.argv[1]))
store.put_deployment(deployment(sys.argv[2]))
store.close()
"""


def test_sqlite_a_second_store_in_the_process_does_not_blind_the_first(tmp_path: Path) -> None:
    # Opening (and closing) another store on the same file must leave the first one's POSIX lock in
    # place: without it, the next process to close believes it is the last, deletes the -wal and -shm
    # files, and the first store keeps reading their deleted copies.
    path = tmp_path / "state.db"
    first = open_store(f"sqlite:///{path}")
    assert first.revision() == 0
    open_store(f"sqlite:///{path}").close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for n, name in enumerate(("a", "b", "c"), start=1):
        subprocess.run([sys.executable, "-c", _WRITER, str(path), name], check=True, env=env, timeout=60)
        assert first.revision() == n  # read between the writers, as the gateway's discovery does
    assert [d.name for d in first.list_deployments()] == ["a", "b", "c"]
    first.close()


def test_sqlite_relative_path_and_reopen_keeps_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store("sqlite:///rel/state.db")
    store.put_deployment(deployment("a"))
    store.put_deployment(deployment("b"))
    store.close()
    assert (tmp_path / "rel" / "state.db").is_file()
    again = open_store("sqlite:///rel/state.db")
    assert again.revision() == 2
    assert [d.name for d in again.list_deployments()] == ["a", "b"]
    again.close()


def test_sqlite_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    open_store(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StateError, match="newer than this Sarv supports") as info:
        open_store(f"sqlite:///{path}")
    assert "\n" not in str(info.value)


def test_sqlite_file_of_schema_3_is_migrated_keeping_its_data(tmp_path: Path) -> None:
    from controlplane.state.base import UsageRecord
    from controlplane.state.sqlite import _MIGRATIONS

    path = tmp_path / "state.db"
    with sqlite3.connect(path) as conn:  # a file written by the Sarv before usage accounting
        for step in (1, 2, 3):
            for statement in _MIGRATIONS[step]:
                conn.execute(statement)
        conn.execute("PRAGMA user_version = 3")
        conn.execute("INSERT INTO teams (name, body) VALUES ('ml', '{\"name\": \"ml\"}')")
    conn.close()
    store = open_store(f"sqlite:///{path}")
    assert [t.name for t in store.list_teams()] == ["ml"]
    store.add_usage([UsageRecord(hour=3600, key="k", model="m", requests=1)])
    assert [r.requests for r in store.list_usage()] == [1]
    store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
    conn.close()


def test_sqlite_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StateError, match="not a SQLite database") as info:
        open_store(f"sqlite:///{path}")
    assert str(path) in str(info.value)


def test_sqlite_writer_waits_for_another_process_lock(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = open_store(f"sqlite:///{path}")
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # another writer holds the lock for a moment
    released = []

    def release() -> None:
        time.sleep(0.3)
        holder.execute("COMMIT")
        released.append(True)

    t = threading.Thread(target=release)
    t.start()
    store.put_deployment(deployment("after-lock"))  # waits on the busy timeout instead of failing
    t.join(timeout=30)
    holder.close()
    assert released == [True]
    assert store.get_deployment("after-lock") is not None
    store.close()


def test_sqlite_path_under_a_file_is_state_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(StateError, match="not-a-dir") as info:
        open_store(f"sqlite:///{blocker / 'state.db'}")
    assert "\n" not in str(info.value)


def test_url_forms_parse() -> None:
    assert parse_state_url("sqlite:////var/lib/sarv/state.db") == SqliteTarget(Path("/var/lib/sarv/state.db"))
    assert parse_state_url("sqlite:///rel.db") == SqliteTarget(Path("rel.db"))
    t = parse_state_url("redis://us%40er:p%3Ass@[::1]:6380/2")
    assert t == RedisTarget(
        nodes=(("::1", 6380),), db=2, tls=False, cluster=False, username="us@er", password="p:ss"
    )
    t = parse_state_url("rediss+cluster://:pw@a:7000,b:7001")
    assert isinstance(t, RedisTarget)
    assert (t.nodes, t.tls, t.cluster, t.username, t.password) == (
        (("a", 7000), ("b", 7001)),
        True,
        True,
        None,
        "pw",
    )
    assert parse_state_url("redis://h") == RedisTarget((("h", 6379),), 0, False, False, None, None)
