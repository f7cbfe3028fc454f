"""An empty path setting means unset: never the current directory (where ansible-core would run scripts)."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from controlplane.cli.main import build_app
from controlplane.settings import Settings, load_settings

# Every setting holding one path (catalog, a list, has its own tests).
_PATH_FIELDS = [name for name, f in Settings.model_fields.items() if f.annotation in (Path, Path | None)]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding an executable that leaves ``MARKER`` behind if anything runs it."""
    for name in list(os.environ):
        if name.startswith("SARV_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "user" / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "user" / "data"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    script = cwd / "inventory.sh"
    script.write_text(f'#!/bin/sh\ntouch "{tmp_path / "MARKER"}"\necho "{{}}"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.chdir(cwd)
    return tmp_path


def test_status_with_empty_sarv_inventory_uses_this_host(sandbox: Path) -> None:
    result = CliRunner().invoke(
        build_app(), ["status", "-o", "json"], env={"SARV_INVENTORY": "", "COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert not (sandbox / "MARKER").exists(), "an inventory script in the current directory was run"
    assert json.loads(result.output)["deployments"] == []
    # The embedded default: SQLite state under the default home.
    assert (sandbox / "user" / "data" / "sarv" / "state.db").is_file()


def test_empty_inventory_option_uses_this_host(sandbox: Path) -> None:
    result = CliRunner().invoke(build_app(), ["inventory", "-i", "", "-o", "json"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert not (sandbox / "MARKER").exists(), "an inventory script in the current directory was run"
    (node,) = json.loads(result.output)["nodes"]
    assert node["name"] == socket.gethostname()
    assert node["address"] == "127.0.0.1"


@pytest.mark.parametrize("field", _PATH_FIELDS)
def test_empty_env_path_is_unset(field: str, sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default = getattr(Settings(), field)
    monkeypatch.setenv(f"SARV_{field.upper()}", "")
    assert getattr(load_settings(), field) == default


def test_empty_env_catalog_is_unset(sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SARV_CATALOG", "")
    assert load_settings().catalog == []


@pytest.mark.parametrize("field", _PATH_FIELDS)
def test_empty_yaml_path_is_unset(field: str, sandbox: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    default = getattr(Settings(), field)
    config = sandbox / "config.yaml"
    config.write_text(f'{field}: ""\ncatalog: ["", "extra.yaml"]\n')
    monkeypatch.setenv("SARV_CONFIG", str(config))
    settings = load_settings()
    assert getattr(settings, field) == default
    assert settings.catalog == [Path("extra.yaml")]


def test_empty_path_argument_is_unset(sandbox: Path) -> None:
    settings = Settings(inventory="", home="")  # type: ignore[arg-type]
    assert settings.inventory is None
    assert settings.home == sandbox / "user" / "data" / "sarv"
