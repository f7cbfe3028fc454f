"""A provisioned GPU node, for real: driver, CUDA, GPUs in containers, model-cache RAID, sysctls."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_provisioned]


def _table_row() -> Any:
    """This host's row of the GPU-generation table (what the driver and CUDA roles installed by default)."""
    from controlplane.catalog.compat import load_compat
    from controlplane.fleet.nvidia_smi import gpus_from_nvidia_smi, query_argv, topology_argv

    query = subprocess.run(query_argv(), capture_output=True, text=True, timeout=120, check=False)
    topo = subprocess.run(topology_argv(), capture_output=True, text=True, timeout=120, check=False)
    gpus = gpus_from_nvidia_smi(query.stdout, topo.stdout, host="localhost")
    return load_compat().generation_for(gpus[0])


def _setting(name: str, pick: Any) -> str:
    return os.environ.get(name) or str(pick(_table_row()))


DRIVER_BRANCH = os.environ.get("SARV_SMOKE_DRIVER_BRANCH", "")
CUDA_VERSION = os.environ.get("SARV_SMOKE_CUDA_VERSION", "")
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
    return settings.vllm_image or load_compat().image_for([_table_row()], settings.vllm_image_repository)


def test_nvidia_smi_lists_gpus() -> None:
    rows = gpu_rows()
    assert len(rows) >= 1
    for index, name, _driver, memory in rows:
        assert index.isdigit()
        assert name
        assert int(float(memory)) > 1024


def test_driver_is_the_pinned_branch(smoke_facts: dict[str, Any]) -> None:
    branch = DRIVER_BRANCH or _setting("SARV_SMOKE_DRIVER_BRANCH", lambda r: r.image.driver_branch)
    drivers = {row[2] for row in gpu_rows()}
    assert len(drivers) == 1, drivers
    (driver,) = drivers
    smoke_facts["driver (wanted branch)"] = f"{driver} ({branch})"
    assert driver.split(".")[0] == branch, f"driver {driver}, expected branch {branch}"


def test_cuda_toolkit_is_the_pinned_release(smoke_facts: dict[str, Any]) -> None:
    cuda = CUDA_VERSION or _setting("SARV_SMOKE_CUDA_VERSION", lambda r: r.image.cuda)
    header = run("nvidia-smi").stdout
    supported = re.search(r"CUDA Version:\s*([0-9]+)\.([0-9]+)", header)
    assert supported, header[:500]
    smoke_facts["CUDA (driver / wanted)"] = f"{supported[1]}.{supported[2]} / {cuda}"
    want = tuple(int(x) for x in cuda.split("."))
    assert (int(supported[1]), int(supported[2])) >= want, f"the driver supports CUDA {supported[0]} only"
    nvcc = Path(f"/usr/local/cuda-{cuda}/bin/nvcc")
    assert nvcc.exists(), f"{nvcc} is missing: the cuda role did not install cuda-toolkit-{cuda}"
    out = run(str(nvcc), "--version")
    assert f"release {cuda}" in out.stdout, out.stdout


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


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _calibrate(home: Path, deployment: dict[str, Any], facts: dict[str, Any]) -> None:
    """Record the estimator's KV-cache tokens per GPU beside what vLLM reported at start-up."""
    from controlplane.catalog import Catalog, estimate

    replica = deployment["replicas"][0]
    log = (home / "replicas" / replica["id"] / "replica.log").read_text(errors="replace")
    found = re.findall(r"KV cache size:\s*([\d,]+)\s*tokens", log)
    assert found, "vLLM's start-up log has no 'KV cache size: N tokens' line"
    reported = int(found[-1].replace(",", ""))
    gpus = gpu_rows()
    model = Catalog.load().get(deployment["model"])
    est = estimate(model, gpu_memory_mib=int(float(gpus[0][3])), gpu_model=gpus[0][1], max_model_len=2048)
    predicted = int(est.kv_budget_mib * 2**20 // est.kv_bytes_per_token_per_gpu)
    facts["KV tokens vLLM / estimate"] = (
        f"{reported} / {predicted} ({(predicted - reported) / reported:+.1%})"
    )


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
def test_a_small_model_is_served_by_a_vllm_replica(tmp_path: Path, smoke_facts: dict[str, Any]) -> None:
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

        from controlplane.state import open_store

        store = open_store(f"sqlite:///{tmp_path / 'home' / 'state.db'}")
        engine_key = store.get_engine_key(name)
        store.close()
        assert engine_key is not None, "the deployment has no engine key"
        auth = {"Authorization": f"Bearer {engine_key.get_secret_value()}"}
        served = httpx.get(f"{endpoint}/v1/models", headers=auth, timeout=30).json()
        served_name = served["data"][0]["id"]
        key = sarv("keys", "create", f"{name}-key").stdout.strip().splitlines()[-1]
        port = _free_port()
        gateway = subprocess.Popen(
            [
                llmctl,
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--metrics-port",
                str(_free_port()),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            reply = None
            for _ in range(60):
                try:
                    reply = httpx.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": served_name, "prompt": "The capital of France is", "max_tokens": 8},
                        timeout=120,
                    )
                    if reply.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(1)
            assert reply is not None and reply.status_code == 200, (
                reply.text if reply else "gateway never answered"
            )
            assert reply.json()["choices"][0]["text"].strip()
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
        _calibrate(tmp_path / "home", deployment, smoke_facts)
    finally:
        sarv("undeploy", name, timeout=300)
