"""The benchmarks' layout and their start-up checks (the benchmarks themselves are not run here)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from fixtures.common import REPO

BENCH = REPO / "bench"


def _load(path: Path) -> ModuleType:
    sys.path.insert(0, str(path.parent))  # the scripts import their siblings (``common``)
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{path.parent.name}_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def _run(script: str, *args: str, path: Path, pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": str(path),
        "HOME": str(path),
        "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath),
    }
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_results_live_in_each_benchmarks_own_results_folder() -> None:
    results = sorted(
        p.relative_to(REPO)
        for p in BENCH.rglob("*")
        if p.is_file() and p.suffix in {".json", ".png", ".md"} and p.name != "README.md"
    )
    assert results, "no recorded results"
    misplaced = [str(p) for p in results if len(p.parts) != 4 or p.parts[2] != "results"]
    assert misplaced == [], "results belong in bench/<name>/results/"
    assert _load(BENCH / "planner" / "run.py").RESULTS == BENCH / "planner" / "results"
    assert _load(BENCH / "gateway" / "common.py").RESULTS == BENCH / "gateway" / "results"


def test_overhead_without_redis_server_says_so_in_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    out = _run("gateway/overhead.py", "--profile", "stress", path=empty, pythonpath=[REPO])
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "redis-server is not installed" in line
    assert "apt-get install redis-server" in line


def test_planner_without_its_solver_says_so_in_one_line(tmp_path: Path) -> None:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "pulp.py").write_text('raise ImportError("pulp is stubbed out for this test")\n')
    out = _run("planner/run.py", "--quick", path=tmp_path, pythonpath=[stubs, REPO])
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "pulp is not installed" in line
    assert "pip install -e '.[bench]'" in line


def test_a_missing_program_stops_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    common = _load(BENCH / "gateway" / "common.py")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as stop:
        common.require_binary("nginx", "apt-get install nginx", also_in=(str(tmp_path),))
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "error: nginx is not installed (not on PATH); install it with `apt-get install nginx`\n"
    )
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    (sbin / "nginx").write_text("#!/bin/sh\n")
    (sbin / "nginx").chmod(0o755)
    found = common.require_binary("nginx", "apt-get install nginx", also_in=(str(sbin),))
    assert found == str(sbin / "nginx")
