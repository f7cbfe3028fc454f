"""`llmctl deploy/status/undeploy` against a fleet of remote hosts: CPU engines go out over SSH too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.testhosts import TestHost

from controlplane.spec import Fleet, Node

pytestmark = [pytest.mark.ssh, pytest.mark.docker, pytest.mark.slow]


def _llmctl(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.xfail(
    reason="open: failed in the fresh-clone CI of 08:40 after the engine-key/weights merges; not yet diagnosed",  # noqa: E501
    strict=False,
)
def test_sim_deploy_from_the_cli_lands_on_the_remote_fleet(
    tmp_path: Path, remote_hosts: list[TestHost], remote_nodes: list[Node]
) -> None:
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_text(Fleet(nodes=remote_nodes).model_dump_json())
    env = {
        **os.environ,
        "SARV_HOME": str(tmp_path / "home"),
        "SARV_INVENTORY": str(fleet_file),
        "SARV_REMOTE_PYTHON": sys.executable,
        "SARV_SSH_KEY_FILE": str(remote_hosts[0].key_path),
        "COLUMNS": "200",
    }
    for var in ("SARV_STATE_URL", "SARV_CONFIG"):
        env.pop(var, None)
    deployed = _llmctl(env, "deploy", "sarv-tiny", "--name", "cli-web", "--engine", "sim", "--replicas", "2")
    try:
        assert deployed.returncode == 0, deployed.stderr
        status = _llmctl(env, "status", "-o", "json")
        assert status.returncode == 0, status.stderr
        [dep] = [d for d in json.loads(status.stdout)["deployments"] if d["name"] == "cli-web"]
        replicas = dep["replicas"]
        assert {r["state"] for r in replicas} == {"ready"}
        # Replicas of one deployment prefer different nodes; each runs as a unit on its node.
        assert sorted(r["node"] for r in replicas) == sorted(h.name for h in remote_hosts)
        for host in remote_hosts:
            units = host.exec(
                "systemctl list-units --no-legend --plain --state=active 'sarv-cli-web-*'", check=False
            ).stdout
            assert len(units.strip().splitlines()) == 1, units
        for r in replicas:
            # The engine listens on the node's private address, reachable from the gateway's network.
            host = next(h for h in remote_hosts if h.name == r["node"])
            port = r["endpoint"].rsplit(":", 1)[1]
            models = host.exec(f"curl -sf http://{host.ip}:{port}/v1/models", check=False).stdout
            assert "cli-web" in models, models
    finally:
        undeployed = _llmctl(env, "undeploy", "cli-web")
    assert undeployed.returncode == 0, undeployed.stderr
    for host in remote_hosts:
        left = host.exec("ls /etc/systemd/system | grep -c '^sarv-cli-web' || true", check=False).stdout
        assert left.strip() == "0", left
