"""Desired and observed state behind one interface: an embedded SQLite file or Redis (standalone/Cluster)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from controlplane.state.base import ApiKeyRecord, StateStore
from controlplane.state.url import RedisTarget, parse_state_url, redact_url

if TYPE_CHECKING:
    from controlplane.settings import Settings

__all__ = ["ApiKeyRecord", "StateStore", "open_store", "redact_url"]


def open_store(url: str, settings: Settings | None = None) -> StateStore:
    """The store behind ``url``: ``sqlite:///PATH``, ``redis[s]://`` or ``redis[s]+cluster://H:P,…``.

    Redis clients come from :mod:`controlplane.state.clients`, which reads credentials (the URL's win over
    ``settings.redis_username``/``redis_password``) and TLS files from ``settings``; the key prefix comes
    from ``settings`` too. A malformed URL raises :class:`~controlplane.errors.ConfigError`;
    Redis is contacted on first use, and failures there raise :class:`~controlplane.errors.StateError`.
    """
    target = parse_state_url(url)
    if not isinstance(target, RedisTarget):
        from controlplane.state.sqlite import SqliteStore

        return SqliteStore(target.path)

    from controlplane.state.clients import redis_endpoint
    from controlplane.state.redis import RedisStore

    return RedisStore(redis_endpoint(url, settings), prefix=settings.state_prefix if settings else "sarv:")
