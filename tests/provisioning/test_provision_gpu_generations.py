"""The driver and CUDA roles choose a node's row of the GPU-generation table as the planner does.

Real ansible-playbook evaluates the roles' defaults and generated vars for hosts declared like an inventory's
GPU nodes (by product name, or by compute capability), on this machine; the row each host gets must be the
one :meth:`CompatTable.generation_for` gives, and the driver branch and CUDA version must be that row's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml
from fixtures.ansible import ansible_env as _env
from fixtures.ansible import tail as _tail
from fixtures.ansible import venv_tool as _tool
from fixtures.common import REPO

from controlplane.catalog.compat import load_compat
from controlplane.spec import GPU

HOSTS = {
    "a100": {"sarv_gpu_model": "A100-SXM4-80GB"},
    "rtx3080": {"sarv_gpu_model": "GeForce RTX 3080"},
    "t4": {"sarv_gpu_model": "Tesla T4"},
    "v100": {"sarv_gpu_model": "Tesla V100-SXM2-32GB"},
    "h100": {"sarv_gpu_model": "NVIDIA H100 80GB HBM3"},
    "by-capability": {"sarv_gpu_model": "Tesla T4", "sarv_gpu_compute_capability": "9.0"},
    "undeclared": {},
}


def test_roles_pick_the_planners_row(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        yaml.safe_dump(
            {"all": {"hosts": {name: {"ansible_connection": "local", **v} for name, v in HOSTS.items()}}}
        )
    )
    role_files = [
        REPO / "roles" / role / sub
        for role in ("nvidia_driver", "cuda")
        for sub in ("defaults/main.yml", "vars/main/gpu_generations.yml")
    ]
    playbook = tmp_path / "show.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Show each node's row",
                    "hosts": "all",
                    "gather_facts": False,
                    "vars_files": [str(p) for p in role_files],
                    "tasks": [
                        {
                            "name": "Row",
                            "ansible.builtin.debug": {
                                "msg": {
                                    "driver": "{{ _nvidia_driver_gpu_generation }}",
                                    "cuda": "{{ _cuda_gpu_generation }}",
                                    "branch": "{{ nvidia_driver_branch | string }}",
                                    "version": "{{ cuda_version | string }}",
                                }
                            },
                        }
                    ],
                }
            ],
            sort_keys=False,
        )
    )
    out = subprocess.run(
        [_tool("ansible-playbook"), "-i", str(inventory), str(playbook)],
        cwd=REPO,
        env=_env(ANSIBLE_STDOUT_CALLBACK="ansible.builtin.json"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, _tail(out.stdout + out.stderr)
    (task,) = json.loads(out.stdout)["plays"][0]["tasks"]
    rows = {host: result["msg"] for host, result in task["hosts"].items()}
    assert set(rows) == set(HOSTS), out.stdout
    table = load_compat()
    for host, declared in HOSTS.items():
        if declared:
            gpu = GPU(
                index=0,
                model=declared["sarv_gpu_model"].removeprefix("NVIDIA "),
                memory_total_mib=1,
                compute_capability=declared.get("sarv_gpu_compute_capability"),
            )
            expected = table.generation_for(gpu)
        else:
            expected = table.generations[
                -1
            ]  # nothing declared: the newest row, whose driver runs every image
        got = rows[host]
        assert got["driver"] == got["cuda"] == expected.name, (host, got)
        assert got["branch"] == expected.image.driver_branch and got["version"] == expected.image.cuda, (
            host,
            got,
        )
