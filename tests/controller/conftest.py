"""Fixtures of the controller tests: a real SQLite store and an HTTP client for the reconcile loop."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from controlplane.state import StateStore, open_store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    s = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    yield s
    s.close()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=2.0, trust_env=False) as c:
        yield c
