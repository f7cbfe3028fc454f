"""docs/gateway.md as tests: its YAML examples are valid gateway configs and its llmctl keys line runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from controlplane.cli.main import main
from controlplane.gateway.config import GatewayConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.parametrize("block", _blocks("yaml"))
def test_yaml_examples_are_valid_configs(block):
    GatewayConfig.model_validate(yaml.safe_load(block))


def test_keys_example_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SARV_CONFIG", str(tmp_path / "absent.yaml"))
    (tmp_path / "absent.yaml").write_text("{}\n")
    monkeypatch.setenv("SARV_HOME", str(tmp_path))
    monkeypatch.setenv("SARV_STATE_URL", f"sqlite:///{tmp_path / 'state.db'}")
    line = next(ln for ln in _blocks("")[0].splitlines() if ln.startswith("llmctl keys create"))
    with pytest.raises(SystemExit) as exc:
        main(shlex.split(line)[1:])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("sk-sarv-")
