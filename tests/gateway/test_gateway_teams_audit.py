"""Teams and the audit trail: ``llmctl teams …``, ``llmctl audit`` and both stores (SQLite, real Redis)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from controlplane.cli.main import main
from controlplane.state.base import AuditEntry, TeamRecord


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("SARV_CONFIG", str(tmp_path / "absent.yaml"))
    (tmp_path / "absent.yaml").write_text("{}\n")
    monkeypatch.setenv("SARV_HOME", str(tmp_path))
    monkeypatch.setenv("SARV_STATE_URL", f"sqlite:///{tmp_path / 'state.db'}")
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_teams_keys_and_audit_through_the_cli(capsys, cli_env):
    assert run(capsys, "teams", "create", "ml", "--rpm", "600", "--monthly-tokens", "1000000")[0] == 0
    code, _, err = run(capsys, "teams", "create", "ml")
    assert code != 0
    assert "exists" in err
    assert run(capsys, "teams", "set", "ml", "--tpm", "5000", "--rpm", "0")[0] == 0
    code, out, err = run(capsys, "keys", "create", "bot", "--team", "ml", "-o", "json")
    assert code == 0, err
    code, _, err = run(capsys, "keys", "create", "orphan", "--team", "nope")
    assert code != 0
    assert "no team named 'nope'" in err
    code, out, _ = run(capsys, "teams", "list", "-o", "json")
    [team] = json.loads(out)
    assert (team["name"], team["rpm"], team["tpm"], team["monthly_tokens"], team["keys"]) == (
        "ml",
        None,
        5000,
        1000000,
        1,
    )
    code, _, err = run(capsys, "teams", "delete", "ml", "--yes")
    assert code != 0
    assert "still has 1 active key" in err
    assert run(capsys, "keys", "revoke", "bot", "--yes")[0] == 0
    assert run(capsys, "teams", "delete", "ml", "--yes")[0] == 0

    code, out, _ = run(capsys, "audit", "-o", "json")
    assert code == 0
    trail = [(e["action"], e["target"], e["outcome"]) for e in json.loads(out)]
    assert trail[0] == ("teams.create", "ml", "ok")
    assert trail[1][0:2] == ("teams.create", "ml")
    assert "exists" in trail[1][2]
    assert ("keys.create", "bot", "ok") in trail
    assert trail[-2:] == [("keys.revoke", "bot", "ok"), ("teams.delete", "ml", "ok")]
    assert all("@" in e["actor"] for e in json.loads(out))
    # the secret of the key never reaches the trail
    assert "sk-sarv-" not in out
    code, out, _ = run(capsys, "audit")
    assert "keys.revoke" in out
    code, out, _ = run(capsys, "audit", "--since", "2099-01-01", "-o", "json")
    assert json.loads(out) == []
    code, _, err = run(capsys, "audit", "--since", "yesterday-ish")
    assert code == 2
    assert "neither a duration" in err


def test_sqlite_audit_is_append_only(cli_env):
    from controlplane.state.sqlite import SqliteStore

    store = SqliteStore(cli_env / "state.db")
    store.append_audit(AuditEntry(at=time.time(), actor="a@h", action="deploy", target="m"))
    store.close()
    conn = sqlite3.connect(cli_env / "state.db")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("UPDATE audit SET body = '{}'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        conn.execute("DELETE FROM audit")
    conn.close()


@pytest.mark.redis
@pytest.mark.parametrize("backend", ["redis", "cluster"])
def test_redis_teams_and_audit(request, backend):
    from controlplane.settings import Settings
    from controlplane.state import open_store

    if backend == "cluster":
        url = request.getfixturevalue("redis_cluster").url
    else:
        url = request.getfixturevalue("redis_url")
    store = open_store(url, Settings(state_prefix=f"t{time.time_ns()}:"))
    try:
        store.put_team(TeamRecord(name="ml", rpm=10))
        assert store.get_team("ml") == TeamRecord(name="ml", rpm=10)
        assert [t.name for t in store.list_teams()] == ["ml"]
        t0 = time.time()
        for i in range(3):
            store.append_audit(AuditEntry(at=t0 + i, actor="a@h", action=f"a{i}"))
        assert [e.action for e in store.list_audit()] == ["a0", "a1", "a2"]
        assert [e.action for e in store.list_audit(t0 + 1)] == ["a1", "a2"]
        assert store.delete_team("ml")
        assert store.get_team("ml") is None
    finally:
        store.close()


def test_a_failed_undeploy_is_in_the_trail_with_its_error(capsys, cli_env):
    code, _, err = run(capsys, "undeploy", "ghost", "--yes")
    assert code != 0
    code, out, _ = run(capsys, "audit", "-o", "json")
    [entry] = json.loads(out)
    assert (entry["action"], entry["target"]) == ("undeploy", "ghost")
    assert entry["outcome"] != "ok"
    assert entry["outcome"] in err
