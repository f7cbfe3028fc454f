"""Every ``$ llmctl`` example in docs/planning.md runs and exits with the code the page gives it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from controlplane.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "planning.md"


def examples() -> list[tuple[list[str], int]]:
    out = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\$ llmctl (.*?)(?:\s+# exit (\d))?$", line)
        if m:
            out.append((shlex.split(m.group(1)), int(m.group(2) or 0)))
    return out


def test_the_page_has_examples() -> None:
    assert len(examples()) >= 6


@pytest.mark.parametrize(
    ("argv", "code"), examples(), ids=lambda v: " ".join(v) if isinstance(v, list) else None
)
def test_doc_example(
    argv: list[str],
    code: int,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "160")
    (tmp_path / "config.yaml").write_text("{}\n")
    monkeypatch.setenv("SARV_CONFIG", str(tmp_path / "config.yaml"))
    for var in ("SARV_INVENTORY", "SARV_CATALOG"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    assert int(exc.value.code or 0) == code, err
    assert (out if code == 0 else out + err).strip()
