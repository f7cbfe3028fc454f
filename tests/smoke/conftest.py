"""GPU smoke suite: runs on a GPU host, skipped anywhere else; ``scripts/smoke`` runs it and prints a summary.

This is the one place where a skip is right even under CI=true: CI machines have no GPU. On a GPU host
every missing piece fails. Two tiers:

- ``test_smoke_gpu_bare.py`` needs only the NVIDIA driver and Python (PyTorch where installed): the real
  ``nvidia-smi`` output parsed by Sarv, ``llmctl inventory`` on this host, the GPU-generation table's row.
  ``scripts/smoke --bare`` runs just this tier (a GPU machine where nothing can be installed).
- ``test_smoke_gpu_host.py`` (marker ``gpu_provisioned``) needs a node provisioned by ``site.yml``: driver
  branch and CUDA against the table, GPUs inside a container, model cache, sysctls, a ``vllm`` replica
  served through the gateway, and the estimator's KV cache against what vLLM reports (calibration).

Settings (environment variables; the defaults follow the GPU-generation table and the roles' defaults):

  SARV_SMOKE_DRIVER_BRANCH   this GPU's table row       nvidia_driver_branch
  SARV_SMOKE_CUDA_VERSION    this GPU's table row       cuda_version
  SARV_SMOKE_MODEL_CACHE     /var/lib/sarv/models      nvme_raid_mount_path
  SARV_SMOKE_SYSCTL_FILE     /etc/sysctl.d/60-sarv-net.conf  (net_tuning)
  SARV_SMOKE_IMAGE           the table's image          a local image the NVIDIA runtime starts
  SARV_SMOKE_MODEL           llama-3-8b                a catalog model (llmctl models)
  SARV_SMOKE_WEIGHTS         (required for the serving test) its weights: directory with SHA256SUMS
  SARV_SMOKE_OUT             (optional) a directory: summary.json and the raw nvidia-smi output go there
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

_FACTS = pytest.StashKey[dict[str, Any]]()


@pytest.fixture(autouse=True)
def _gpu_host(request: pytest.FixtureRequest) -> None:
    if "tests/smoke/" not in str(request.path).replace(os.sep, "/"):
        return
    if shutil.which("nvidia-smi") is None:
        pytest.skip(
            "needs an NVIDIA GPU host: nvidia-smi is not installed here (run scripts/smoke on a GPU node)"
        )
    probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False)
    if probe.returncode != 0 and "No devices were found" in probe.stdout + probe.stderr:
        pytest.skip("needs an NVIDIA GPU host: nvidia-smi finds no GPU here")


@pytest.fixture
def smoke_facts(request: pytest.FixtureRequest) -> dict[str, Any]:
    """What the suite measured (versions, GPUs, calibration): printed at the end, saved to SARV_SMOKE_OUT."""
    return request.config.stash.setdefault(_FACTS, {})


def smoke_out() -> Path | None:
    """Where raw outputs go (``SARV_SMOKE_OUT``), created on first use; None when unset."""
    raw = os.environ.get("SARV_SMOKE_OUT", "").strip()
    if not raw:
        return None
    out = Path(raw)
    out.mkdir(parents=True, exist_ok=True)
    return out


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    facts = config.stash.get(_FACTS, {})
    if not facts:
        return
    terminalreporter.section("Sarv GPU smoke summary")
    for key, value in facts.items():
        terminalreporter.write_line(f"{key:28} {value}")
    out = smoke_out()
    if out is not None:
        (out / "summary.json").write_text(json.dumps(facts, indent=2, default=str) + "\n")
        terminalreporter.write_line(f"{'written':28} {out / 'summary.json'}")
