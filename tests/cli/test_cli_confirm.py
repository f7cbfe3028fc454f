"""Destructive commands ask on a terminal (default no) and not in scripts or with --yes."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from controlplane.gateway.auth import hash_key
from controlplane.settings import Settings
from controlplane.state import open_store


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "config.yaml").write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SARV_")}
    return env | {
        "SARV_HOME": str(tmp_path),
        "SARV_STATE_URL": f"sqlite:///{tmp_path / 'state.db'}",
        "SARV_CONFIG": str(tmp_path / "config.yaml"),
        "COLUMNS": "120",
    }


def _llmctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "controlplane.cli.main", *args]


def _on_a_terminal(argv: list[str], env: dict[str, str], answer: bytes) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as stdin, answer its question with ``answer``."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 60
    answered = False
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        if not answered and b"?" in seen:
            os.write(leader, answer)
            answered = True
        if proc.poll() is not None and not ready:
            break
    code = proc.wait(timeout=30)
    os.close(leader)
    return code, seen.decode(errors="replace")


def _revoked(tmp_path: Path, key: str) -> bool:
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}", Settings(home=tmp_path))
    try:
        record = store.get_api_key(hash_key(key))
        assert record is not None
        return record.revoked
    finally:
        store.close()


@pytest.fixture
def key(tmp_path: Path) -> str:
    made = subprocess.run(
        _llmctl("keys", "create", "team-a"), env=_env(tmp_path), capture_output=True, text=True, check=True
    )
    return made.stdout.strip().splitlines()[-1]


def test_revoke_on_a_terminal_asks_and_no_changes_nothing(tmp_path: Path, key: str) -> None:
    code, seen = _on_a_terminal(_llmctl("keys", "revoke", "team-a"), _env(tmp_path), b"n\r")
    assert "revoke key 'team-a'?" in seen
    assert code == 1 and "nothing changed" in seen
    assert not _revoked(tmp_path, key)


def test_revoke_on_a_terminal_yes_revokes(tmp_path: Path, key: str) -> None:
    code, seen = _on_a_terminal(_llmctl("keys", "revoke", "team-a"), _env(tmp_path), b"y\r")
    assert code == 0, seen
    assert _revoked(tmp_path, key)


def test_revoke_with_yes_on_a_terminal_does_not_ask(tmp_path: Path, key: str) -> None:
    code, seen = _on_a_terminal(_llmctl("keys", "revoke", "team-a", "--yes"), _env(tmp_path), b"n\r")
    assert code == 0, seen
    assert "?" not in seen
    assert _revoked(tmp_path, key)


def test_undeploy_on_a_terminal_asks_first(tmp_path: Path) -> None:
    code, seen = _on_a_terminal(_llmctl("undeploy", "nothing-here"), _env(tmp_path), b"n\r")
    assert "undeploy 'nothing-here'" in seen
    assert code == 1 and "nothing changed" in seen
