"""GPU smoke suite: runs on a provisioned GPU node (after site.yml), skipped anywhere else.

This is the one place where a skip is right even under CI=true: CI machines have no GPU. On a GPU host
every missing piece fails. Settings (environment variables, defaults match the roles' defaults):

  SARV_SMOKE_DRIVER_BRANCH   550                       nvidia_driver_branch
  SARV_SMOKE_CUDA_VERSION    12.4                      cuda_version
  SARV_SMOKE_MODEL_CACHE     /var/lib/sarv/models      nvme_raid_mount_path
  SARV_SMOKE_SYSCTL_FILE     /etc/sysctl.d/60-sarv-net.conf  (net_tuning)
  SARV_SMOKE_IMAGE           Sarv's vllm_image setting  a local image the NVIDIA runtime starts
  SARV_SMOKE_MODEL           llama-3-8b                a catalog model (llmctl models)
  SARV_SMOKE_WEIGHTS         (required for the serving test) its weights: directory with SHA256SUMS
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


@pytest.fixture(autouse=True)
def _gpu_host(request: pytest.FixtureRequest) -> None:
    if "tests/smoke/" not in str(request.path).replace(os.sep, "/"):
        return
    if shutil.which("nvidia-smi") is None:
        pytest.skip(
            "needs an NVIDIA GPU host: nvidia-smi is not installed here (run tests/smoke on a GPU node)"
        )
    probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False)
    if probe.returncode != 0 and "No devices were found" in probe.stdout + probe.stderr:
        pytest.skip("needs an NVIDIA GPU host: nvidia-smi finds no GPU here")
