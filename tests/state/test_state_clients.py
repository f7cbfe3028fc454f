"""The one Redis client factory: every URL form, TLS with client certificates, errors without secrets."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.common import free_port
from fixtures.redis import CLUSTER_PASSWORD, CLUSTER_USER, TlsAclCluster
from state.records import deployment

from controlplane.controller.lease import open_lease
from controlplane.errors import ConfigError, StateError
from controlplane.settings import Settings
from controlplane.state import open_store
from controlplane.state.clients import async_client, is_redis_url, redis_endpoint, sync_client

SECRET = "clients-Secret-" + "w" * 8


def test_url_forms_and_settings_resolve_to_one_endpoint(tmp_path: Path) -> None:
    for url in ("redis://h", "rediss://h:1/2", "redis+cluster://a:1,b:2", "rediss+cluster://u:p@a:1"):
        assert is_redis_url(url)
    assert not is_redis_url(f"sqlite:///{tmp_path / 's.db'}")
    with pytest.raises(ConfigError, match="not a Redis URL"):
        redis_endpoint(f"sqlite:///{tmp_path / 's.db'}")
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    settings = Settings(redis_username="from-settings", redis_password="settings-pw", redis_tls_ca=ca)
    from_url = redis_endpoint(f"rediss+cluster://user:{SECRET}@a:1,b:2", settings)
    assert (from_url.target.username, from_url.target.password) == ("user", SECRET)
    assert from_url.target.nodes == (("a", 1), ("b", 2))
    assert from_url.tls_ca == ca
    assert from_url.shown == "rediss+cluster://user:***@a:1,b:2"
    assert SECRET not in repr(from_url)
    assert from_url.scrub(f"auth {SECRET} failed") == "auth *** failed"
    from_settings = redis_endpoint("redis://h:1/0", settings)
    assert (from_settings.target.username, from_settings.target.password) == ("from-settings", "settings-pw")


def test_unreachable_cluster_lease_is_a_state_error_without_the_password() -> None:
    port = free_port()  # nothing listens here
    with pytest.raises(StateError) as info:
        open_lease(f"redis+cluster://sarv:{SECRET}@127.0.0.1:{port}", None, ttl_s=5)
    message = str(info.value)
    assert f"sarv:***@127.0.0.1:{port}" in message
    assert SECRET not in message
    assert "\n" not in message


@pytest.mark.redis
async def test_store_lease_and_limiter_client_share_a_tls_cluster_endpoint(
    tls_acl_cluster: TlsAclCluster,
) -> None:
    tls = tls_acl_cluster.tls
    url = tls_acl_cluster.url(tls=True, credentials=False)
    settings = Settings(
        state_prefix="clients:",
        redis_username=CLUSTER_USER,
        redis_password=CLUSTER_PASSWORD,
        redis_tls_ca=tls.ca,
        redis_tls_cert=tls.client_cert,
        redis_tls_key=tls.client_key,
    )
    store = open_store(url, settings)
    store.put_deployment(deployment("tls-cluster"))
    assert store.get_deployment("tls-cluster") == deployment("tls-cluster")
    store.close()

    lease, close = open_lease(url, settings, ttl_s=5, holder="tls")
    try:
        assert lease.acquire()
        assert lease.owner() == "tls"
        lease.release()
    finally:
        close()

    client = async_client(redis_endpoint(url, settings))
    try:
        assert await client.ping()
    finally:
        await client.aclose()

    # The nodes ask for a client certificate: without one the handshake fails, as a StateError.
    no_cert = settings.model_copy(update={"redis_tls_cert": None, "redis_tls_key": None})
    with pytest.raises(StateError) as info:
        sync_client(redis_endpoint(url, no_cert))
    assert CLUSTER_PASSWORD not in str(info.value)
