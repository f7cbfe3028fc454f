"""The gateway on every Redis state URL form: limits shared through Redis, TLS, credentials, outages."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from fixtures.common import free_port
from fixtures.gateway import GatewayStarter
from fixtures.redis import CLUSTER_PASSWORD, CLUSTER_USER, RedisServer, TlsAclCluster

from controlplane.gateway.ratelimit import KeyLimits, RedisLimiter
from controlplane.gateway.server import build_app
from controlplane.settings import Settings
from controlplane.state import open_store

SECRET = "gw-Secret-" + "z" * 10


def _settings(tmp_path: Path, url: str, **fields: object) -> Settings:
    return Settings(home=tmp_path, state_url=url, state_prefix=f"urls-{uuid.uuid4().hex[:8]}:", **fields)


async def _two_gateways_admit(settings: Settings) -> list[bool]:
    """Two gateways built from the same settings take turns on one key limited to 2 requests a minute."""
    apps = [build_app(settings) for _ in range(2)]
    try:
        assert all(isinstance(app.limiter, RedisLimiter) for app in apps)
        limits = KeyLimits(rpm=2)
        now = time.time()
        decisions = [await apps[i % 2].limiter.admit("shared", limits, 1, now) for i in range(4)]
        assert not any(d.backend_error for d in decisions), [d.reason for d in decisions]
        return [d.allowed for d in decisions]
    finally:
        for app in apps:
            await app.limiter.close()
            app.store.close()


@pytest.mark.redis
async def test_cluster_url_credentials_reach_the_server(
    tmp_path: Path, tls_acl_cluster: TlsAclCluster
) -> None:
    settings = _settings(tmp_path, tls_acl_cluster.url(tls=False))
    assert await _two_gateways_admit(settings) == [True, True, False, False]


@pytest.mark.redis
async def test_tls_cluster_limits_are_shared(tmp_path: Path, tls_acl_cluster: TlsAclCluster) -> None:
    tls = tls_acl_cluster.tls
    settings = _settings(
        tmp_path,
        tls_acl_cluster.url(tls=True, credentials=False),
        redis_username=CLUSTER_USER,
        redis_password=CLUSTER_PASSWORD,
        redis_tls_ca=tls.ca,
        redis_tls_cert=tls.client_cert,
        redis_tls_key=tls.client_key,
    )
    assert await _two_gateways_admit(settings) == [True, True, False, False]


@pytest.mark.redis
async def test_rediss_limiter_trusts_the_configured_ca(tmp_path: Path, tls_redis: tuple[int, Path]) -> None:
    port, ca = tls_redis
    settings = _settings(tmp_path, f"rediss://127.0.0.1:{port}/0", redis_tls_ca=ca)
    assert await _two_gateways_admit(settings) == [True, True, False, False]


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
async def test_unreachable_store_at_start_up_is_logged_without_credentials(
    tmp_path: Path, scheme: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()  # nothing listens here
    url = f"{scheme}://sarv:{SECRET}@127.0.0.1:{port}" + ("/0" if scheme == "redis" else "")
    app = build_app(_settings(tmp_path, url))
    with caplog.at_level(logging.WARNING, logger="controlplane.gateway"):
        await app.startup()
        await app.shutdown()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("start-up" in w and f"sarv:***@127.0.0.1:{port}" in w for w in warnings), warnings
    assert not any(SECRET in w for w in warnings)


@pytest.mark.redis
def test_store_errors_reach_clients_without_the_store_url(
    gateway_factory: GatewayStarter, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    # The server has no user "intruder": every read of the store fails with WRONGPASS.
    store = open_store(f"redis://intruder:{SECRET}@127.0.0.1:{redis_server.port}/0")
    gw = gateway_factory(store)
    with caplog.at_level(logging.WARNING, logger="controlplane.gateway"):
        r = httpx.get(f"{gw.url}/v1/models", headers={"Authorization": "Bearer sk-sarv-x"}, timeout=10)
    assert r.status_code == 503
    error = r.json()["error"]
    assert error["code"] == "state_unavailable"
    assert set(error) >= {"message", "type", "code"}
    for leak in (SECRET, "intruder", str(redis_server.port), "redis://", "127.0.0.1"):
        assert leak not in r.text
    logged = [rec.getMessage() for rec in caplog.records]
    assert any(f"intruder:***@127.0.0.1:{redis_server.port}" in m for m in logged), logged
    assert not any(SECRET in m for m in logged)
    store.close()


@pytest.mark.redis
@pytest.mark.slow
def test_llmctl_gateway_workers_on_a_tls_cluster(tmp_path: Path, tls_acl_cluster: TlsAclCluster) -> None:
    (tmp_path / "absent.yaml").write_text("{}\n")
    tls = tls_acl_cluster.tls
    port = free_port()
    env = {
        "SARV_HOME": str(tmp_path),
        "SARV_CONFIG": str(tmp_path / "absent.yaml"),
        "SARV_STATE_URL": tls_acl_cluster.url(tls=True),
        "SARV_REDIS_TLS_CA": str(tls.ca),
        "SARV_REDIS_TLS_CERT": str(tls.client_cert),
        "SARV_REDIS_TLS_KEY": str(tls.client_key),
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "controlplane.cli.main",
            "gateway",
            "--workers",
            "2",
            "--port",
            str(port),
            "--metrics-port",
            str(free_port()),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        health = None
        deadline = time.monotonic() + 60
        while health is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.2)
        assert proc.poll() is None, f"gateway exited {proc.returncode}"
        assert health == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert CLUSTER_PASSWORD.encode() not in err
