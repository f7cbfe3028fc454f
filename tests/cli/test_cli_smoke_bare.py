"""The GPU smoke suite's bare tier, run here against a stand-in nvidia-smi (the suite needs a GPU host).

The stand-in prints a recorded H100 query (with compute_cap) and topology, so the tier's own code — the
parser, `llmctl inventory`, the generation table, the summary — is exercised on every CI run; only the
numbers of a real GPU are left to the GPU host. PyTorch's check is left out (it needs CUDA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "tests" / "fleet" / "samples"


def test_bare_tier_passes_on_a_stand_in_gpu_host(tmp_path: Path) -> None:
    query = "".join(
        line.rstrip("\n") + ", 9.0\n"
        for line in (SAMPLES / "h100-sxm-8gpu.query.csv").read_text().splitlines(True)
    )
    (tmp_path / "query.csv").write_text(query)
    (tmp_path / "topo.txt").write_text((SAMPLES / "h100-sxm-8gpu.topo.txt").read_text())
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  topo) cat {tmp_path}/topo.txt ;;\n"
        f"  --query-gpu=*) cat {tmp_path}/query.csv ;;\n"
        '  -L) for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-x$i)"; done ;;\n'
        "  *) echo 'NVIDIA-SMI 575.57.08  Driver Version: 575.57.08  CUDA Version: 12.9' ;;\n"
        "esac\n"
    )
    fake.chmod(0o755)
    out_dir = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SARV_")}
    env |= {"PATH": f"{bindir}{os.pathsep}{env['PATH']}", "SARV_SMOKE_OUT": str(out_dir)}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "not cuda_sees",
            str(ROOT / "tests" / "smoke" / "test_smoke_gpu_bare.py"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 passed" in run.stdout, run.stdout[-2000:]
    assert "Sarv GPU smoke summary" in run.stdout and "hopper" in run.stdout
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["generation"] == "hopper" and "cc9.0" in summary["gpus"]
    assert (out_dir / "nvidia-smi.query.csv").read_text() == query
