"""The test harness itself: ``wait_ready`` (tests/fixtures/common.py), which the Prometheus, Alertmanager
and simulator fixtures use to wait for a server.

It must wait through the 503s a server answers while it starts, and fail at once, naming the log, when the
server's process has exited (a bad config), instead of after its whole bound.
"""

from __future__ import annotations

import re
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from fixtures.common import free_port, http_server, need_binary, stop_process, wait_ready


def _answering(answers: list[int]) -> type[BaseHTTPRequestHandler]:
    """A handler that answers each GET with the next status of ``answers``, the last one from then on."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(answers.pop(0) if len(answers) > 1 else answers[0])
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def test_waits_through_503_until_200() -> None:
    answers = [503, 503, 200]
    with http_server(_answering(answers)) as port:
        wait_ready(f"http://127.0.0.1:{port}/-/ready", timeout=30)
    assert answers == [200]


def test_a_server_that_stays_unready_times_out_with_what_it_said() -> None:
    with (
        http_server(_answering([503])) as port,
        pytest.raises(TimeoutError, match="not ready after 1s: HTTP 503"),
    ):
        wait_ready(f"http://127.0.0.1:{port}/-/ready", timeout=1)


def test_an_exited_process_fails_the_wait_at_once_naming_its_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(timeout=30)
    # The bound is long: a wait that ignored the exit would end in TimeoutError, not this error.
    with pytest.raises(RuntimeError, match="exited with 3 before it was ready; see " + re.escape(str(log))):
        wait_ready(f"http://127.0.0.1:{free_port()}/-/ready", timeout=120, proc=proc, log=log)


def test_prometheus_with_a_bad_config_is_named_at_once(tmp_path: Path) -> None:
    binary = need_binary("prometheus")
    (tmp_path / "prometheus.yml").write_text("scrape_configs: [{job_name: x, scrape_interval: nonsense}]\n")
    log = tmp_path / "prometheus.log"
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with pytest.raises(RuntimeError, match=r"exited with \d+ before it was ready; see .*prometheus.log"):
            wait_ready(f"http://127.0.0.1:{port}/-/ready", timeout=120, proc=proc, log=log)
    finally:
        stop_process(proc)
    assert "nonsense" in log.read_text()
