"""The controller lease against a real redis-server (SET NX PX + CAS renewal) and the SQLite lock file."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from controlplane.controller.lease import FileLease, RedisLease, open_lease
from controlplane.errors import ConfigError, StateError
from controlplane.settings import Settings
from controlplane.state.url import parse_state_url

KEY = "{sarv:}controller-lease"


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def wait_until_gone(client: redis.Redis, key: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while client.exists(key):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key} still set after {timeout}s")
        time.sleep(0.05)


@pytest.mark.redis
def test_one_holder_at_a_time(client: redis.Redis) -> None:
    a = RedisLease(client, KEY, ttl_s=30, holder="a")
    b = RedisLease(client, KEY, ttl_s=30, holder="b")
    assert a.acquire() is True
    assert b.acquire() is False
    assert client.get(KEY) == "a"
    assert (a.held(), b.held()) == (True, False)
    assert b.owner() == "a"


@pytest.mark.redis
def test_renewal_extends_the_ttl_and_keeps_the_holder(client: redis.Redis) -> None:
    a = RedisLease(client, KEY, ttl_s=30, holder="a")
    assert a.acquire()
    client.pexpire(KEY, 1000)  # pretend most of the TTL went by
    assert a.acquire() is True
    assert client.pttl(KEY) > 1000
    assert client.get(KEY) == "a"


@pytest.mark.redis
def test_release_lets_the_other_take_over_at_once(client: redis.Redis) -> None:
    a = RedisLease(client, KEY, ttl_s=30, holder="a")
    b = RedisLease(client, KEY, ttl_s=30, holder="b")
    assert a.acquire()
    a.release()
    assert a.held() is False
    assert b.acquire() is True
    assert client.get(KEY) == "b"


@pytest.mark.redis
def test_release_never_deletes_a_successors_lease(client: redis.Redis) -> None:
    a = RedisLease(client, KEY, ttl_s=30, holder="a")
    b = RedisLease(client, KEY, ttl_s=30, holder="b")
    assert a.acquire()
    client.delete(KEY)  # a's lease ran out
    assert b.acquire()
    a.release()
    assert client.get(KEY) == "b"


@pytest.mark.redis
def test_expired_lease_is_taken_by_the_standby_and_lost_by_the_old_holder(client: redis.Redis) -> None:
    a = RedisLease(client, KEY, ttl_s=0.5, holder="a")
    b = RedisLease(client, KEY, ttl_s=30, holder="b")
    assert a.acquire()
    assert b.acquire() is False
    wait_until_gone(client, KEY)  # a stopped renewing
    assert b.acquire() is True
    assert a.acquire() is False  # the old holder's renewal cannot steal it back
    assert a.held() is False
    assert client.get(KEY) == "b"


@pytest.mark.redis
def test_trust_window_is_shorter_than_the_ttl(client: redis.Redis) -> None:
    now = [100.0]
    a = RedisLease(client, KEY, ttl_s=10, holder="a", monotonic=lambda: now[0])
    assert a.acquire()
    now[0] += 7.9
    assert a.held() is True
    now[0] += 0.2  # past 80 % of the TTL: the key may be about to expire in Redis
    assert a.held() is False


def test_unreachable_redis_is_a_state_error() -> None:
    from fixtures.common import free_port

    with redis.Redis(port=free_port(), socket_connect_timeout=1, socket_timeout=1) as c:
        lease = RedisLease(c, KEY, ttl_s=5, holder="a")
        with pytest.raises(StateError, match="controller lease"):
            lease.acquire()
        assert lease.held() is False


@pytest.mark.redis
def test_open_lease_uses_the_state_prefix_as_hash_tag(redis_url: str, client: redis.Redis) -> None:
    lease, close = open_lease(redis_url, Settings(state_prefix="site1:"), ttl_s=5, holder="x")
    try:
        assert lease.acquire()
        assert client.get("{site1:}controller-lease") == "x"
    finally:
        lease.release()
        close()


@pytest.mark.redis
def test_lease_works_on_redis_cluster(redis_cluster: object) -> None:
    url = redis_cluster.url  # type: ignore[attr-defined]
    a, close_a = open_lease(url, None, ttl_s=30, holder="a")
    b, close_b = open_lease(url, None, ttl_s=30, holder="b")
    try:
        assert a.acquire() is True
        assert b.acquire() is False
        a.release()
        assert b.acquire() is True
    finally:
        b.release()
        close_a()
        close_b()


def test_open_lease_refuses_a_non_positive_ttl(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="TTL"):
        open_lease("redis://127.0.0.1:1/0", None, ttl_s=0)


def test_sqlite_lease_is_a_lock_file_next_to_the_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    a, close_a = open_lease(url, None, ttl_s=5, holder="a")
    b, close_b = open_lease(url, None, ttl_s=5, holder="b")
    try:
        assert a.acquire() is True
        assert a.acquire() is True  # idempotent for the holder
        assert b.acquire() is False
        assert (tmp_path / "state.db.controller.lock").is_file()
        assert b.owner() == "a"
        close_a()
        assert b.acquire() is True
        assert a.owner() == "b"
    finally:
        close_a()
        close_b()


def test_file_lock_is_dropped_when_the_holder_process_dies(tmp_path: Path) -> None:
    import subprocess
    import sys

    lock = tmp_path / "state.db.controller.lock"
    code = (
        "import sys, pathlib; from controlplane.controller.lease import FileLease; "
        "l = FileLease(pathlib.Path(sys.argv[1]), holder='child'); "
        "print(l.acquire(), flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "True"
            mine = FileLease(lock, holder="parent")
            assert mine.acquire() is False
            child.kill()
            child.wait(timeout=10)
            assert mine.acquire() is True
            mine.release()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=10)


def test_state_url_for_lock_is_parsed_like_the_store() -> None:
    with pytest.raises(ConfigError):
        open_lease("mysql://x", None, ttl_s=5)
    assert parse_state_url("sqlite:///tmp/x.db")
