"""`llmctl deploy/status/undeploy` against a fleet of remote hosts: CPU engines go out over SSH too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.testhosts import TestHost
from fixtures.vllm import LlmctlEnv

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
    env["SARV_STATE_URL"] = f"sqlite:///{tmp_path / 'home' / 'state.db'}"
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
        engine_key = LlmctlEnv(home=tmp_path / "home", env=env).engine_key("cli-web")
        assert engine_key
        for r in replicas:
            # The engine listens on the node's private address, reachable from the gateway's network, and
            # answers only a caller presenting the deployment's engine key (the gateway, the probes).
            host = next(h for h in remote_hosts if h.name == r["node"])
            url = f"http://{host.ip}:{r['endpoint'].rsplit(':', 1)[1]}/v1/models"
            bare = host.exec(f"curl -s -o /dev/null -w '%{{http_code}}' {url}", check=False).stdout
            assert bare.strip() == "401", bare
            auth = f"Authorization: Bearer {engine_key}"  # a throwaway test host: argv is fine here
            models = host.exec(f"curl -sf -H '{auth}' {url}", check=False).stdout
            assert "cli-web" in models, models
    finally:
        undeployed = _llmctl(env, "undeploy", "cli-web")
    assert undeployed.returncode == 0, undeployed.stderr
    for host in remote_hosts:
        left = host.exec("ls /etc/systemd/system | grep -c '^sarv-cli-web' || true", check=False).stdout
        assert left.strip() == "0", left
