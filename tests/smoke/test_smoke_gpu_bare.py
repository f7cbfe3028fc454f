"""A GPU host as Sarv sees it, with nothing installed but the driver and Python (PyTorch where present).

Real ``nvidia-smi --query-gpu`` and ``topo -m`` output through Sarv's parser, ``llmctl inventory`` on this
host, the GPU-generation table's row for each GPU, and (where PyTorch is installed) the same GPUs and compute
capabilities as CUDA reports them. With SARV_SMOKE_OUT set, the raw outputs are saved there so they can be
added to tests/fleet/samples/.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from smoke.conftest import smoke_out

from controlplane.catalog.compat import load_compat
from controlplane.fleet.nvidia_smi import gpus_from_nvidia_smi, query_argv, topology_argv
from controlplane.spec import GPU

pytestmark = pytest.mark.gpu


def _run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def _listed() -> list[str]:
    return [ln for ln in _run(["nvidia-smi", "-L"]).stdout.splitlines() if ln.startswith("GPU ")]


def _discovered() -> list[GPU]:
    query = _run(query_argv())
    if query.returncode != 0:  # a driver before R510: no compute_cap field
        query = _run(query_argv(legacy=True))
    topo = _run(topology_argv())
    assert query.returncode == 0 and topo.returncode == 0, query.stderr + topo.stderr
    out = smoke_out()
    if out is not None:
        (out / "nvidia-smi.query.csv").write_text(query.stdout)
        (out / "nvidia-smi.topo.txt").write_text(topo.stdout)
        (out / "nvidia-smi.txt").write_text(_run(["nvidia-smi"]).stdout)
    return gpus_from_nvidia_smi(query.stdout, topo.stdout, host="localhost")


def test_sarv_parses_this_hosts_nvidia_smi(smoke_facts: dict[str, Any]) -> None:
    gpus = _discovered()
    assert len(gpus) == len(_listed()) >= 1
    for g in gpus:
        assert g.memory_total_mib > 1024 and g.uuid.startswith("GPU-"), g
        assert g.compute_capability, f"GPU {g.index}: nvidia-smi gave no compute_cap (driver before R510?)"
    smoke_facts["gpus"] = ", ".join(
        f"{g.index}:{g.model} {g.memory_total_mib} MiB cc{g.compute_capability}" for g in gpus
    )
    smoke_facts["nvlink peers"] = {g.index: g.nvlink_peers for g in gpus}


def test_every_gpu_has_a_row_in_the_generation_table(smoke_facts: dict[str, Any]) -> None:
    table = load_compat()
    rows = {g.index: table.generation_for(g) for g in _discovered()}
    # The product name alone must lead to the same row (declared inventories have only the name).
    for g in _discovered():
        by_name = table.by_model(g.model)
        assert by_name is not None, f"{g.model!r} is not matched by any row's `models` patterns"
        assert by_name.name == rows[g.index].name, (g.model, by_name.name, rows[g.index].name)
    smoke_facts["generation"] = ", ".join(sorted({r.name for r in rows.values()}))
    smoke_facts["engine image"] = ", ".join(sorted({r.image.tag for r in rows.values()}))


def test_llmctl_inventory_lists_this_hosts_gpus(tmp_path: Any) -> None:
    env_home = tmp_path / "home"
    out = subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", "inventory", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("SARV_")}
        | {"SARV_HOME": str(env_home), "XDG_CONFIG_HOME": str(tmp_path / "xdg")},
    )
    assert out.returncode == 0, out.stderr
    (node,) = json.loads(out.stdout)["nodes"]
    want = _discovered()
    assert [(g["index"], g["model"], g["memory_total_mib"]) for g in node["gpus"]] == [
        (g.index, g.model, g.memory_total_mib) for g in want
    ]
    assert [g["compute_capability"] for g in node["gpus"]] == [g.compute_capability for g in want]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="PyTorch is not installed on this host")
def test_cuda_sees_the_same_gpus(smoke_facts: dict[str, Any]) -> None:
    import torch

    assert torch.cuda.is_available(), "PyTorch cannot initialise CUDA on this host"
    # CUDA may order devices differently from nvidia-smi (fastest first): compare as multisets.
    want = sorted((g.compute_capability, g.memory_total_mib // 1024) for g in _discovered())
    got = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        got.append((f"{props.major}.{props.minor}", props.total_memory // 2**30))
    assert sorted(got) == want
    smoke_facts["torch / CUDA"] = f"{torch.__version__} / {torch.version.cuda}"
