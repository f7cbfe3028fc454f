"""Connections to replicas notice a vanished host: the gateway's upstream sockets carry TCP_USER_TIMEOUT and
keepalive from ``limits.dead_peer_timeout_s``, and the gateway's own pool is built with them.

What the options do to a host that disappears without a reset (requests fail over instead of hanging until
``request_timeout_s``) is exercised by tests/remote/test_remote_chaos.py, which stops a host container.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.gateway import make_store

from controlplane.gateway import app as gateway_app
from controlplane.gateway.config import GatewayConfig, LimitsConfig
from controlplane.gateway.upstream import upstream_socket_factory

pytestmark = pytest.mark.skipif(
    not hasattr(socket, "TCP_USER_TIMEOUT"), reason="TCP_USER_TIMEOUT is Linux-only"
)


def _opt(sock: socket.socket, level: int, name: str) -> int:
    return sock.getsockopt(level, getattr(socket, name))


def test_upstream_sockets_give_up_on_a_silent_peer_after_the_configured_time() -> None:
    info = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 0))
    with upstream_socket_factory(12.0)(info) as sock:
        assert _opt(sock, socket.IPPROTO_TCP, "TCP_USER_TIMEOUT") == 12_000
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        idle = _opt(sock, socket.IPPROTO_TCP, "TCP_KEEPIDLE")
        interval = _opt(sock, socket.IPPROTO_TCP, "TCP_KEEPINTVL")
        count = _opt(sock, socket.IPPROTO_TCP, "TCP_KEEPCNT")
        # An idle pooled connection is dropped after about the same time as unacknowledged data.
        assert idle + interval * count <= 12
    with upstream_socket_factory(LimitsConfig().dead_peer_timeout_s)(info) as sock:
        assert _opt(sock, socket.IPPROTO_TCP, "TCP_USER_TIMEOUT") == 10_000


def test_the_gateway_pool_uses_the_factory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    made: list[float] = []
    real = gateway_app.upstream_socket_factory

    def spy(timeout: float) -> Callable[[Any], socket.socket]:
        made.append(timeout)
        return real(timeout)

    monkeypatch.setattr(gateway_app, "upstream_socket_factory", spy)
    store = make_store(tmp_path)
    config = GatewayConfig(limits=LimitsConfig(dead_peer_timeout_s=7))

    async def start_and_stop() -> None:
        gw = gateway_app.GatewayApp(store=store, config=config)
        await gw.startup()
        await gw.shutdown()

    try:
        asyncio.run(start_and_stop())
    finally:
        store.close()
    assert made == [7]  # one factory: the proxy pool's and discovery's sockets alike
