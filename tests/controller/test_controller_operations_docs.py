"""docs/operations.md is tested: its YAML example loads as deployments, its dry-run lines are what
``Change.describe`` prints, and every option it names exists on the commands it documents."""

from __future__ import annotations

import re
from pathlib import Path

from fixtures.fleets import gpu_fleet
from typer.testing import CliRunner

from controlplane.cli.main import build_app
from controlplane.controller.apply import load_manifest, plan_changes

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "operations.md"


def test_yaml_example_loads_and_its_dry_run_reads_as_documented(sim_deployer, tmp_path: Path) -> None:
    (block,) = re.findall(r"^```yaml\n(.*?)^```$", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)
    path = tmp_path / "deployments.yaml"
    path.write_text(block)
    d = sim_deployer(gpu_fleet())
    specs = load_manifest(path, d)
    assert [(s.name, s.replicas, s.engine.value) for s in specs] == [("chat", 2, "vllm"), ("tiny", 1, "sim")]
    assert specs[0].engine_args == {"max_num_seqs": 64}
    lines = [c.describe() for c in plan_changes(d, specs)]
    assert lines[0] in DOC.read_text()


def test_options_named_in_the_doc_exist() -> None:
    runner = CliRunner()
    helps = ""
    for command in ("scale", "apply", "cordon", "uncordon", "drain", "events", "deploy", "rollout"):
        result = runner.invoke(build_app(), [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        helps += result.output
    named = set(re.findall(r"`(?:llmctl [a-z]+ [^`]*?)?(--[a-z-]+)", DOC.read_text()))
    named |= set(re.findall(r"(--[a-z-]+)", "\n".join(re.findall(r"^llmctl .*$", DOC.read_text(), re.M))))
    assert {"--drain-timeout", "--dry-run", "--timeout", "--since"} <= named
    missing = sorted(o for o in named if o not in helps)
    assert missing == []
