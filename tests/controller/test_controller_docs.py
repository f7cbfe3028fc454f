"""docs/controller.md is tested: its YAML example loads, and every option it names exists."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from controlplane.cli.main import build_app
from controlplane.controller.reconcile import ControllerConfig, load_controller_config

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "controller.md"


def test_yaml_example_is_a_valid_config(tmp_path: Path) -> None:
    (block,) = re.findall(r"^```yaml\n(.*?)^```$", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)
    path = tmp_path / "controller.yaml"
    path.write_text(block)
    cfg = load_controller_config(path)
    assert cfg.policy_for("chat").max_replicas == 6
    assert cfg.policy_for("chat").scale_to_zero is False
    # The example spells out every top-level key, so a renamed setting fails here.
    assert set(ControllerConfig.model_fields) - {"deployments", "autoscale"} <= set(
        re.findall(r"^([a-z_]+):", block, flags=re.MULTILINE)
    )


def test_options_named_in_the_doc_exist() -> None:
    result = CliRunner().invoke(build_app(), ["controller", "run", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    named = set(re.findall(r"`(--[a-z-]+)", DOC.read_text()))
    assert named, "the doc names no option"
    missing = sorted(o for o in named if o not in result.output)
    assert missing == []
