"""Fixtures of the observability tests: a real Prometheus on loopback reading a file_sd target file."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.common import free_port, need_binary, stop_process, wait_ready

RULES = Path(__file__).resolve().parents[2] / "dashboards" / "rules" / "sarv.rules.yml"


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A real Prometheus on loopback with Sarv's rules, whose one scrape job reads a file_sd file."""
    binary = need_binary("prometheus")
    targets = tmp_path / "targets" / "replicas.json"
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{RULES}']\n"
        "scrape_configs:\n  - job_name: sarv-replicas\n    file_sd_configs:\n"
        f"      - files: ['{targets}']\n        refresh_interval: 1s\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}/-/ready", timeout=30, proc=proc, log=tmp_path / "prometheus.log")
        yield port, targets
    finally:
        stop_process(proc)
        log.close()
