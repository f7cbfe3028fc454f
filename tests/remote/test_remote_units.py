"""Unit rendering and the pure helpers of the remote launchers, checked against systemd's own parser."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
from fixtures.common import need

from controlplane.errors import LaunchError
from controlplane.launchers.ray import ray_active_nodes
from controlplane.launchers.ssh import _foreground_docker, _protect_home, _tmp_binds
from controlplane.launchers.units import UnitSpec, env_file_path, render_unit, systemd_quote, unit_name

_RAY_STATUS = """======== Autoscaler status: 2026-11-29 10:21:47.304192 ========
Node status
---------------------------------------------------------------
Active:
 1 node_8b7030c56b6275b375e4d9fd6c1e3bb3e6c7ebe4b541e9c58b35efcb
 1 node_1a2b3c
Pending:
 1 node_ffff
Recent failures:
 (no failures)
"""


def _spec(**kw: object) -> UnitSpec:
    base: dict[str, object] = {
        "name": "sarv-web-0.service",
        "description": "Sarv replica web-0",
        "argv": ["/opt/sarv/venv/bin/python", "-m", "controlplane.simulator", "--port", "8000"],
    }
    return UnitSpec(**(base | kw))  # type: ignore[arg-type]


def test_unit_has_the_hardening_options_and_no_secret() -> None:
    text = render_unit(_spec(env={"SARV_SIM": "1"}, env_file=env_file_path("sarv-web-0.service")))
    lines = text.splitlines()
    for option in (
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "DynamicUser=yes",
        "CapabilityBoundingSet=",
        "RestrictSUIDSGID=yes",
        "UMask=0077",
        "EnvironmentFile=/etc/sarv/replicas/sarv-web-0.env",
        'Environment="SARV_SIM=1"',
        "Type=exec",
    ):
        assert option in lines, option
    assert lines[0].startswith("# Managed by Sarv")


def test_specifiers_and_variables_stay_literal() -> None:
    assert systemd_quote("50%") == '"50%%"'
    assert systemd_quote("$HOME") == '"$$HOME"'
    assert systemd_quote('say "hi"\\') == '"say \\"hi\\"\\\\"'
    with pytest.raises(LaunchError, match="line break"):
        systemd_quote("a\nb")


def test_names_and_env_are_validated() -> None:
    assert unit_name("web-0") == "sarv-web-0.service"
    assert unit_name("web-0", "ray-head") == "sarv-web-0-ray-head.service"
    with pytest.raises(LaunchError, match="cannot name a systemd unit"):
        unit_name("../etc")
    with pytest.raises(ValueError, match="environment entry"):
        _spec(env={"BAD KEY": "1"})
    with pytest.raises(ValueError, match="not a sarv"):
        _spec(name="ssh.service")


def test_a_venv_under_tmp_is_bound_into_the_private_tmp() -> None:
    assert _tmp_binds("/opt/sarv/venv/bin/python") == []
    assert _tmp_binds("/tmp/checkout/.venv/bin/python") == ["/tmp/checkout"]
    assert _tmp_binds("/var/tmp/ci/.venv/bin/python") == ["/var/tmp/ci"]


def test_protect_home_follows_the_resolved_interpreter() -> None:
    assert _protect_home("/opt/sarv/venv/bin/python3.11") == "yes"
    assert _protect_home("/root/.pyenv/versions/3.11.7/bin/python3.11") == "read-only"
    assert _protect_home("/home/sarv/venv/bin/python") == "read-only"


def test_container_runs_in_the_foreground_under_systemd() -> None:
    argv = [
        "docker",
        "run",
        "--detach",
        "--name",
        "sarv-x",
        "--restart",
        "on-failure:5",
        "img",
        "--port",
        "1",
    ]
    assert _foreground_docker(argv) == ["docker", "run", "--name", "sarv-x", "img", "--port", "1"]


def test_ray_status_counts_only_active_nodes() -> None:
    assert ray_active_nodes(_RAY_STATUS) == 2
    assert ray_active_nodes("no status") == 0


def test_systemd_analyze_accepts_the_unit(tmp_path: Path) -> None:
    """systemd's own parser reads the rendered unit without a complaint (where systemd is installed)."""
    analyze = shutil.which("systemd-analyze")
    need(analyze is not None, "systemd-analyze is not installed (apt-get install systemd)")
    assert analyze is not None
    unit = tmp_path / "sarv-web-0.service"
    spec = _spec(
        argv=["/bin/true", "50%", "$x"],
        env_file=PurePosixPath(str(tmp_path / "sarv-web-0.env")),
        joins_namespace_of="sarv-web-0-ray-head.service",
    )
    unit.write_text(render_unit(spec))
    (tmp_path / "sarv-web-0.env").write_text("")
    res = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, check=False, timeout=60
    )
    complaints = [ln for ln in res.stderr.splitlines() if "sarv-web-0" in ln and "ray-head" not in ln]
    assert not complaints, res.stderr
