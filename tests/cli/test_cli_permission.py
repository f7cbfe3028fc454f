"""A file the user may not write is a one-line error naming it, not a traceback."""

from __future__ import annotations

import pytest
import typer

from controlplane.cli import main as cli_main


def test_permission_denied_is_one_line_naming_the_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    app = typer.Typer()

    @app.command()
    def deploy() -> None:
        raise PermissionError(13, "Permission denied", "/var/lib/sarv/models/m/.sarv-verified.json")

    monkeypatch.setattr(cli_main, "build_app", lambda: app)
    with pytest.raises(SystemExit) as exited:
        cli_main.main([])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: permission denied: /var/lib/sarv/models/m/.sarv-verified.json")
    assert "Traceback" not in err
