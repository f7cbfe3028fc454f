"""docs/fleet.md is tested: its console examples print exactly what they show, its YAML examples load."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.fleet import load_fleet
from controlplane.spec import Interconnect

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "fleet.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)


def console_examples() -> list[tuple[str, str]]:
    examples = []
    for block in blocks("console"):
        command, _, output = block.partition("\n")
        examples.append((command.removeprefix("$ "), output))
    return examples


@pytest.mark.parametrize(("command", "expected"), console_examples())
def test_console_example(command: str, expected: str, tmp_path: Path) -> None:
    argv = shlex.split(command)
    assert argv[0] == "llmctl"
    r = subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", *argv[1:]],
        cwd=REPO,
        # A fixed width and an empty HOME (no user config; ansible-core writes ~/.ansible/tmp there).
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected


def test_yaml_examples_load(tmp_path: Path) -> None:
    inventory, fleet_file = blocks("yaml")
    (tmp_path / "hosts.yml").write_text(inventory)
    p1, p2 = load_fleet(tmp_path / "hosts.yml").nodes
    assert len(p1.gpus) == 4 and [g.model for g in p2.gpus] == ["A100-PCIE-40GB", "Tesla V100-PCIE-16GB"]
    (tmp_path / "fleet.yaml").write_text(fleet_file)
    (node,) = load_fleet(tmp_path / "fleet.yaml").nodes
    assert node.interconnect is Interconnect.PCIE and node.gpus[0].pcie_switch == "pcie0"
