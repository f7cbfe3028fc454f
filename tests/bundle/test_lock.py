"""The checked-in lock files pin every runtime dependency of pyproject.toml, within its range, with hashes."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from controlplane.bundle.lock import LOCK_DIR, lock_path, normalize_name, read_lock
from controlplane.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
LOCKS = sorted(LOCK_DIR.glob("lock-py*.txt"))


def runtime_requirements() -> list[Requirement]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [Requirement(r) for r in data["project"]["dependencies"]]


def test_a_lock_per_fleet_python() -> None:
    assert [p.name for p in LOCKS] == ["lock-py311.txt", "lock-py312.txt"]


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_runtime_dependency_is_pinned_in_range_with_hashes(lock: Path) -> None:
    pins = read_lock(lock)
    for req in runtime_requirements():
        pin = pins.get(normalize_name(req.name))
        assert pin is not None, f"{req.name} is in pyproject.toml but not in {lock.name}: run scripts/lock"
        assert req.specifier.contains(pin.version, prereleases=True), (
            f"{lock.name} pins {req.name}=={pin.version}, outside {req.specifier}: run scripts/lock"
        )
    # The transitive set is pinned too, every entry with at least one file hash.
    assert len(pins) > len(runtime_requirements())
    assert all(p.hashes for p in pins.values())


def test_unpinned_lines_and_missing_versions_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "lock-py311.txt"
    bad.write_text("httpx>=0.27\n")
    with pytest.raises(ConfigError, match="not pinned with =="):
        read_lock(bad)
    with pytest.raises(ConfigError, match=r"no lock file for Python 3\.9 .*available: lock-py311\.txt"):
        lock_path("3.9", tmp_path)
