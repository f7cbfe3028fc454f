"""Fixtures of the state tests: an ACL-protected redis-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fixtures.redis import _start_redis
from state.records import ACL_PASSWORD, ACL_USER


@pytest.fixture(scope="session")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A redis-server whose default user is disabled; only ACL_USER with ACL_PASSWORD may connect."""
    port, proc = _start_redis(
        tmp_path_factory.mktemp("redis-acl"),
        "--user", "default", "off",
        "--user", ACL_USER, "on", f">{ACL_PASSWORD}", "~*", "&*", "+@all",
    )  # fmt: skip
    yield port
    proc.terminate()
    proc.wait(timeout=10)
