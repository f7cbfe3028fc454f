"""The benchmarks' layout and their start-up checks (the benchmarks themselves are not run here)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
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


def test_flat_upstream_and_open_loop_client(tmp_path: Path) -> None:
    """The overhead benchmark's upstream (flatsse.c) keeps its deadlines and answers as vLLM does, and the
    open-loop client reads every answer whole: the same seeded schedule, every sample accounted for."""
    exe = tmp_path / "flatsse"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(BENCH / "gateway" / "flatsse.c")], check=True)
    common = _load(BENCH / "gateway" / "common.py")
    loadgen = _load(BENCH / "gateway" / "loadgen.py")
    port = common.free_port()
    proc = subprocess.Popen([str(exe), str(port), "m1", "20", "5", "4"])
    try:
        url = f"http://127.0.0.1:{port}"
        common.wait_http(f"{url}/health", timeout=10)
        import httpx

        assert "vllm:num_requests_running" in httpx.get(f"{url}/metrics").text
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "m1"
        assert httpx.post(f"{url}/v1/completions/render", json={}).status_code == 404
        usage = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "m1", "stream": True, "stream_options": {"include_usage": True}},
        )
        events = [line for line in usage.text.splitlines() if line.startswith("data: ")]
        assert len(events) == 4 + 2 and events[-1] == "data: [DONE]"
        assert '"completion_tokens":4' in events[-2]
        whole = httpx.post(f"{url}/v1/completions", json={"model": "m1", "stream": False}).json()
        assert whole["usage"]["completion_tokens"] == 4 and whole["choices"][0]["text"] == " tok" * 4

        assert loadgen.schedule(50, 2.0, 7) == loadgen.schedule(50, 2.0, 7) != loadgen.schedule(50, 2.0, 8)
        # a connection the server closed while idle (uvicorn does after 5 s) is never sent a request
        run = loadgen._Run(True, (0.0, 0.0))
        gone, live = loadgen._Conn(run), loadgen._Conn(run)
        live.transport = type("T", (), {"is_closing": lambda self: False})()
        run.idle = [live, gone]
        assert run.take() is live and run.take() is None
        for stream in (True, False):
            body = json.dumps({"model": "m1", "prompt": "x", "stream": stream}).encode()
            res = asyncio.run(
                loadgen.open_loop(
                    f"{url}/v1/completions",
                    body,
                    {"Content-Type": "application/json"},
                    stream=stream,
                    rate=40,
                    duration=1.0,
                    warmup=0.5,
                    seed=3,
                    pool=2,  # fewer than in flight: the client opens more as it needs them
                )
            )
            arrivals = loadgen.schedule(40, 1.5, 3)
            assert res.sent == len(arrivals) == res.completed
            assert len(res.samples) == sum(1 for a in arrivals if a >= 0.5)
            assert res.opened_in_run > 0
            for s in res.samples:
                assert s.ok and s.status == 200
                # absolute deadlines: never earlier than the profile says
                assert s.e2e >= 0.020 + 3 * 0.005
                assert s.ttft >= (0.020 if stream else 0.035)
                assert (s.ttft <= s.e2e) if stream else (s.ttft == s.e2e)
                assert s.chunks >= (4 if stream else 1)
            # streamed: the first token before the end (three more follow it 5 ms apart). A client that falls
            # behind on a loaded machine may read a whole stream at once, so not in every sample.
            if stream:
                assert any(s.ttft < s.e2e for s in res.samples)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
