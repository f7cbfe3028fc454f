"""A provisioned GPU node, for real: driver, CUDA, GPUs in containers, model-cache RAID, sysctls."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

DRIVER_BRANCH = os.environ.get("SARV_SMOKE_DRIVER_BRANCH", "550")
CUDA_VERSION = os.environ.get("SARV_SMOKE_CUDA_VERSION", "12.4")
MODEL_CACHE = Path(os.environ.get("SARV_SMOKE_MODEL_CACHE", "/var/lib/sarv/models"))
SYSCTL_FILE = Path(os.environ.get("SARV_SMOKE_SYSCTL_FILE", "/etc/sysctl.d/60-sarv-net.conf"))


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


def gpu_rows() -> list[list[str]]:
    out = run(
        "nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader,nounits"
    )
    assert out.returncode == 0, out.stderr
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def image() -> str:
    configured = os.environ.get("SARV_SMOKE_IMAGE")
    if configured:
        return configured
    from controlplane.catalog.compat import load_compat
    from controlplane.settings import Settings

    settings = Settings()
    table = load_compat()
    return settings.vllm_image or table.image_for(list(table.generations), settings.vllm_image_repository)


def test_nvidia_smi_lists_gpus() -> None:
    rows = gpu_rows()
    assert len(rows) >= 1
    for index, name, _driver, memory in rows:
        assert index.isdigit()
        assert name
        assert int(float(memory)) > 1024


def test_driver_is_the_pinned_branch() -> None:
    drivers = {row[2] for row in gpu_rows()}
    assert len(drivers) == 1, drivers
    (driver,) = drivers
    assert driver.split(".")[0] == DRIVER_BRANCH, f"driver {driver}, expected branch {DRIVER_BRANCH}"


def test_cuda_toolkit_is_the_pinned_release() -> None:
    header = run("nvidia-smi").stdout
    supported = re.search(r"CUDA Version:\s*([0-9]+)\.([0-9]+)", header)
    assert supported, header[:500]
    want = tuple(int(x) for x in CUDA_VERSION.split("."))
    assert (int(supported[1]), int(supported[2])) >= want, f"the driver supports CUDA {supported[0]} only"
    nvcc = Path(f"/usr/local/cuda-{CUDA_VERSION}/bin/nvcc")
    assert nvcc.exists(), f"{nvcc} is missing: the cuda role did not install cuda-toolkit-{CUDA_VERSION}"
    out = run(str(nvcc), "--version")
    assert f"release {CUDA_VERSION}" in out.stdout, out.stdout


def test_sarv_discovery_reads_this_host() -> None:
    """Sarv's own nvidia-smi parser against the real tool: same GPUs as `nvidia-smi -L`."""
    from controlplane.fleet.nvidia_smi import gpus_from_nvidia_smi, query_argv, topology_argv

    query = run(*query_argv())
    topo = run(*topology_argv())
    assert query.returncode == 0 and topo.returncode == 0, query.stderr + topo.stderr
    gpus = gpus_from_nvidia_smi(query.stdout, topo.stdout, host="localhost")
    listed = [ln for ln in run("nvidia-smi", "-L").stdout.splitlines() if ln.startswith("GPU ")]
    assert len(gpus) == len(listed)
    assert all(g.memory_total_mib > 1024 for g in gpus)


def _docker() -> str:
    docker = shutil.which("docker")
    assert docker, "docker is not installed: the docker role did not run on this GPU node"
    return docker


def test_gpus_visible_inside_a_container_and_after_daemon_reload() -> None:
    """The NVIDIA runtime hands every GPU to a container, and they stay after `systemctl daemon-reload`.

    The second half is the known failure with the systemd cgroup driver: GPUs vanish from running
    containers when systemd re-applies cgroup device rules.
    """
    docker = _docker()
    img = image()
    present = run(docker, "image", "inspect", img)
    assert present.returncode == 0, (
        f"image {img} is not on this host (pull it from the site mirror or set SARV_SMOKE_IMAGE)"
    )
    host_gpus = len(gpu_rows())
    name = f"sarv-smoke-{uuid.uuid4().hex[:8]}"
    started = run(
        docker,
        "run",
        "-d",
        "--name",
        name,
        "--runtime=nvidia",
        "--gpus",
        "all",
        "--entrypoint",
        "sleep",
        img,
        "600",
        timeout=300,
    )
    assert started.returncode == 0, started.stderr
    try:
        inside = run(docker, "exec", name, "nvidia-smi", "-L")
        assert inside.returncode == 0, inside.stderr
        assert len([ln for ln in inside.stdout.splitlines() if ln.startswith("GPU ")]) == host_gpus
        reload = run("systemctl", "daemon-reload")
        assert reload.returncode == 0, reload.stderr
        after = run(docker, "exec", name, "nvidia-smi", "-L")
        assert after.returncode == 0, f"GPUs lost after daemon-reload: {after.stdout}{after.stderr}"
        assert len([ln for ln in after.stdout.splitlines() if ln.startswith("GPU ")]) == host_gpus
    finally:
        run(docker, "rm", "-f", name, timeout=120)


def test_model_cache_is_mounted() -> None:
    assert os.path.ismount(MODEL_CACHE), f"{MODEL_CACHE} is not a mount point (nvme_raid role)"
    found = run("findmnt", "-J", "-o", "SOURCE,FSTYPE", "--target", str(MODEL_CACHE))
    assert found.returncode == 0, found.stderr
    (fs,) = json.loads(found.stdout)["filesystems"]
    assert fs["fstype"] in {"xfs", "ext4"}, fs
    if fs["source"].startswith("/dev/md"):
        md = Path(fs["source"]).resolve().name
        mdstat = Path("/proc/mdstat").read_text()
        line = next((ln for ln in mdstat.splitlines() if ln.startswith(md + " ")), "")
        assert "active raid0" in line, mdstat


def test_sarv_sysctls_are_applied() -> None:
    assert SYSCTL_FILE.exists(), f"{SYSCTL_FILE} is missing (net_tuning role)"
    wanted = {}
    for raw in SYSCTL_FILE.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if "=" in line:
            key, value = (p.strip() for p in line.split("=", 1))
            wanted[key] = " ".join(value.split())
    assert wanted, f"{SYSCTL_FILE} sets nothing"
    live = {k: " ".join(Path("/proc/sys", *k.split(".")).read_text().split()) for k in wanted}
    assert live == wanted


def deploy_argv(model: str, name: str, weights: str) -> list[str]:
    """The `llmctl` arguments the serving test deploys with (checked against the CLI off the GPU host)."""
    return [
        "deploy",
        model,
        "--name",
        name,
        "--engine",
        "vllm",
        "--source",
        weights,
        "--max-model-len",
        "2048",
        "--wait",
        "--timeout",
        "1200",
    ]


@pytest.mark.timeout(1800)
def test_a_small_model_is_served_by_a_vllm_replica(tmp_path: Path) -> None:
    """`llmctl deploy` a catalog model on this node's GPU (vLLM container), complete a prompt, undeploy."""
    weights = os.environ.get("SARV_SMOKE_WEIGHTS")
    assert weights, "set SARV_SMOKE_WEIGHTS to the model's weights (a directory with a SHA256SUMS manifest)"
    model = os.environ.get("SARV_SMOKE_MODEL", "llama-3-8b")
    llmctl = shutil.which("llmctl") or str(Path(sys.executable).parent / "llmctl")
    env = {**os.environ, "SARV_HOME": str(tmp_path / "home"), "SARV_STATE_URL": ""}
    name = f"smoke-{uuid.uuid4().hex[:6]}"

    def sarv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [llmctl, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
        )

    deployed = sarv(*deploy_argv(model, name, weights), timeout=1500)
    try:
        assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
        status = json.loads(sarv("status", "--output", "json").stdout)
        (deployment,) = [d for d in status["deployments"] if d["name"] == name]
        endpoint = deployment["replicas"][0]["endpoint"]
        assert endpoint, deployment
        import httpx

        served = httpx.get(f"{endpoint}/v1/models", timeout=30).json()
        served_name = served["data"][0]["id"]
        reply = httpx.post(
            f"{endpoint}/v1/completions",
            json={
                "model": served_name,
                "prompt": "The capital of France is",
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"].strip()
    finally:
        sarv("undeploy", name, timeout=300)
