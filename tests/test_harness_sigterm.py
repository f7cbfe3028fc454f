"""The test harness itself: a pytest run stopped by SIGTERM removes what its session made (tests/conftest.py).

A run cancelled by CI or killed by ``timeout`` gets SIGTERM; without the handler the process dies at once,
and its test-host containers and network stay behind on the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.common import REPO, need
from fixtures.testhosts import IMAGE, _docker, _docker_ready

INNER = """
import os, time
from pathlib import Path

def test_hold(testhost_factory):
    (host,) = testhost_factory(1, prefix="sigterm")
    Path(os.environ["SARV_SIGTERM_MARK"]).write_text(host.container)
    time.sleep(300)
"""


@pytest.mark.docker
@pytest.mark.timeout(300)
def test_sigterm_tears_the_session_down(tmp_path: Path) -> None:
    need(_docker_ready(), "no Docker daemon (scripts/test starts dockerd)")
    need(_docker("image", "inspect", IMAGE, check=False).returncode == 0, f"image {IMAGE} missing")
    inner = tmp_path / "test_inner.py"
    inner.write_text(INNER)
    mark = tmp_path / "container"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest"]
    argv += ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO), str(inner)]
    proc = subprocess.Popen(
        argv,
        cwd=tmp_path,
        env={**os.environ, "SARV_SIGTERM_MARK": str(mark)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    container = net = ""
    try:
        deadline = time.monotonic() + 180
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert mark.exists(), proc.communicate(timeout=60)[0] if proc.poll() is not None else "no host"
        container = mark.read_text()
        networks = "{{range $k, $v := .NetworkSettings.Networks}}{{$k}}{{end}}"
        net = _docker("inspect", "-f", networks, container).stdout.strip()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert "KeyboardInterrupt" in out, out
        assert _docker("inspect", container, check=False).returncode != 0, f"{container} outlived the run"
        assert _docker("network", "inspect", net, check=False).returncode != 0, f"{net} outlived the run"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        if container:  # what a run that did not tear down left
            _docker("rm", "-f", container, check=False)
        if net:
            _docker("network", "rm", net, check=False)
