"""The whole site.yml on three container hosts (Molecule scenario ``molecule/site``).

Two GPU nodes with a fake ``nvidia-smi`` and one service node: the Redis Cluster forms and answers,
Prometheus scrapes its targets, the control plane's services start, and ``llmctl inventory`` on the
rendered inventory lists the fake GPUs (see molecule/site/tests/test_site.py for the checks).
"""

from __future__ import annotations

import uuid

import pytest
import yaml
from fixtures.common import REPO

from .test_provision_service_roles import molecule_test


def test_site_scenario_declares_two_gpu_nodes_and_one_service_node() -> None:
    scenario = yaml.safe_load((REPO / "molecule" / "site" / "molecule.yml").read_text())
    groups = [set(p["groups"]) for p in scenario["platforms"]]
    assert sum("gpu_nodes" in g for g in groups) == 2
    assert sum({"redis", "monitoring", "controlplane"} <= g for g in groups) == 1
    # all three hosts share one user-defined network named after the run
    networks = {n["name"] for p in scenario["platforms"] for n in p["networks"]}
    assert len(networks) == 1


@pytest.mark.molecule
@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_molecule_site() -> None:
    molecule_test(REPO, f"sarv-site-{uuid.uuid4().hex[:8]}", "-s", "site", timeout=2200)
