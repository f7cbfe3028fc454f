"""Desired and observed state behind one interface: an embedded SQLite file or Redis (standalone/Cluster)."""

from controlplane.state.base import ApiKeyRecord, StateStore

__all__ = ["ApiKeyRecord", "StateStore"]
