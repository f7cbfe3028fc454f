"""A multi-node replica's per-node launchers get the same home and model cache as single-node ones."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

import controlplane.launchers as launchers
from controlplane.launchers.ray import RayLauncher
from controlplane.launchers.ssh import SshLauncher
from controlplane.settings import Settings
from controlplane.spec import Node


def test_group_launcher_passes_home_and_model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, Path, Path]] = []

    def launcher_for(node: Node, home: Path, model_cache: Path, settings: object = None) -> SshLauncher:
        seen.append((node.name, home, model_cache))
        return SshLauncher(
            node,
            None,  # type: ignore[arg-type]  # never used: nothing is started
            host=node.address,
            python="python3",
            remote_cache=PurePosixPath("/var/lib/sarv/models"),
            local_cache=model_cache,
        )

    monkeypatch.setattr(launchers, "launcher_for", launcher_for)
    settings = Settings(home=tmp_path / "home", model_cache=tmp_path / "cache")
    nodes = [Node(name="a", address="10.0.0.1"), Node(name="b", address="10.0.0.2")]

    group = launchers.group_launcher_for(nodes, settings.resolved_model_cache, settings)

    assert isinstance(group, RayLauncher)
    home, cache = tmp_path / "home", tmp_path / "cache"
    assert seen == [("a", home, cache), ("b", home, cache)]
