"""Desired and observed state behind one interface: an embedded SQLite file or Redis (standalone/Cluster)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controlplane.state.base import ApiKeyRecord, StateStore
from controlplane.state.url import RedisTarget, parse_state_url, redact_url

if TYPE_CHECKING:
    from controlplane.settings import Settings

__all__ = ["ApiKeyRecord", "StateStore", "open_store", "redact_url"]


def open_store(url: str, settings: Settings | None = None) -> StateStore:
    """The store behind ``url``: ``sqlite:///PATH``, ``redis://``, ``rediss://`` or ``redis+cluster://H:P,…``.

    Credentials in the URL win over ``settings.redis_username``/``redis_password``; TLS files and the
    key prefix come from ``settings``. A malformed URL raises :class:`~controlplane.errors.ConfigError`;
    Redis is contacted on first use, and failures there raise :class:`~controlplane.errors.StateError`.
    """
    target = parse_state_url(url)
    if not isinstance(target, RedisTarget):
        from controlplane.state.sqlite import SqliteStore

        return SqliteStore(target.path)

    from controlplane.state.redis import RedisStore

    if settings is not None:
        target = RedisTarget(
            nodes=target.nodes,
            db=target.db,
            tls=target.tls,
            cluster=target.cluster,
            username=target.username or settings.redis_username,
            password=target.password if target.password is not None else settings.redis_password,
        )
    return RedisStore(
        target,
        shown_url=redact_url(url),
        prefix=settings.state_prefix if settings else "sarv:",
        tls_ca=settings.redis_tls_ca if settings else None,
        tls_cert=settings.redis_tls_cert if settings else None,
        tls_key=settings.redis_tls_key if settings else None,
    )
