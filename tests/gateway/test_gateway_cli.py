"""``llmctl keys create|list|revoke`` and ``llmctl gateway`` through ``main()`` against a SQLite store."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path

import httpx
import pytest
from fixtures.common import free_port, need
from fixtures.gateway import gateway_process

from controlplane.cli.keys import parse_duration
from controlplane.cli.main import main
from controlplane.errors import UserError
from controlplane.gateway.auth import hash_key


def _has_store() -> bool:
    import controlplane.state

    return hasattr(controlplane.state, "open_store")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    need(_has_store(), "controlplane.state.open_store is not available yet")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("SARV_CONFIG", str(tmp_path / "absent.yaml"))
    (tmp_path / "absent.yaml").write_text("{}\n")
    monkeypatch.setenv("SARV_HOME", str(tmp_path))
    monkeypatch.setenv("SARV_STATE_URL", f"sqlite:///{tmp_path / 'state.db'}")


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def _store(tmp_path: Path):
    from controlplane.settings import Settings
    from controlplane.state import open_store

    return open_store(f"sqlite:///{tmp_path / 'state.db'}", Settings(home=tmp_path))


def test_create_json_list_revoke(capsys, tmp_path):
    code, out, err = run(
        capsys, "keys", "create", "ci-bot", "--model", "m1", "--rpm", "60", "--tpm", "1000", "-o", "json"
    )
    assert code == 0, err
    data = json.loads(out)
    assert list(data) == ["name", "key"]
    assert data["key"].startswith("sk-sarv-")
    store = _store(tmp_path)
    record = store.get_api_key(hash_key(data["key"]))
    assert record is not None
    assert (record.name, record.models, record.rpm, record.tpm) == ("ci-bot", ["m1"], 60, 1000)
    # only the hash is stored: the key appears nowhere in the database file
    assert data["key"].encode() not in (tmp_path / "state.db").read_bytes()

    code, out, _ = run(capsys, "keys", "list")
    assert code == 0
    assert "ci-bot" in out
    assert data["key"] not in out
    assert "active" in out

    code, out, err = run(capsys, "keys", "create", "ci-bot")
    assert code == 2
    assert "exists" in err

    code, out, _ = run(capsys, "keys", "revoke", "ci-bot")
    assert code == 0
    assert store.get_api_key(hash_key(data["key"])).revoked
    code, out, _ = run(capsys, "keys", "list", "-o", "json")
    assert json.loads(out)[0]["revoked"] is True
    assert "key_hash" not in json.loads(out)[0]

    code, _, err = run(capsys, "keys", "revoke", "nobody")
    assert code == 2
    assert "no key named 'nobody'" in err


def test_text_output_shows_the_key_once_and_expiry(capsys, tmp_path):
    code, out, _ = run(capsys, "keys", "create", "temp", "--expires-in", "2h")
    assert code == 0
    key = out.strip().splitlines()[-1]
    record = _store(tmp_path).get_api_key(hash_key(key))
    assert record.expires_at == pytest.approx(time.time() + 7200, abs=60)
    code, _, err = run(capsys, "keys", "create", "bad", "--expires-in", "soon")
    assert code == 2
    assert "--expires-in" in err
    code, out, err = run(capsys, "keys", "create", "gone", "--expires-in", "0d")
    assert code == 2
    assert "over before the key exists" in err and not out
    assert all(k.name != "gone" for k in _store(tmp_path).list_api_keys())


def test_parse_duration():
    assert parse_duration("30d") == 30 * 86400
    assert parse_duration("90s") == 90
    with pytest.raises(UserError):
        parse_duration("3 weeks")


@pytest.mark.slow
def test_llmctl_gateway_serves(tmp_path, capsys, sim_server):
    sim = sim_server(served_model_name="m1")
    from fixtures.gateway import add_key, add_replica

    store = _store(tmp_path)
    add_replica(store, sim.url, "m1", rid="m1-0")
    key = add_key(store, "cli")
    with gateway_process(tmp_path) as (port, _):
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "m1", "prompt": "x", "max_tokens": 2},
            timeout=10,
        )
        assert r.status_code == 200, r.text
    # more than one worker needs Redis (limits are shared only there)
    code, _, err = run(capsys, "gateway", "--workers", "2", "--port", str(free_port()))
    assert code == 2
    assert "needs Redis" in err


@pytest.mark.slow
def test_clients_trickling_headers_get_408_and_others_are_served(tmp_path):
    _store(tmp_path)
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("limits:\n  header_timeout_s: 1\n")
    with gateway_process(tmp_path, "--config", str(cfg)) as (port, _):
        silent = socket.create_connection(("127.0.0.1", port))
        slow = socket.create_connection(("127.0.0.1", port))
        try:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            for _ in range(4):  # a header line now and then, never the end of the headers
                time.sleep(0.3)
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
                with contextlib.suppress(OSError):
                    slow.sendall(b"X-Trickle: 1\r\n")
            for sock in (slow, silent):
                # waits 10 s at most, far beyond the 1 s deadline: a missing deadline fails here
                answer = _read_until_closed(sock)
                assert answer.startswith(b"HTTP/1.1 408"), answer
                assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"
        finally:
            slow.close()
            silent.close()


def _read_until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    return answer


@pytest.mark.slow
def test_endless_headers_are_cut_off_while_arriving(tmp_path):
    # 16 KiB of headers (+ 8 KiB for the request line) is the limit; this client never stops sending.
    _store(tmp_path)
    with gateway_process(tmp_path) as (port, _), socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(OSError):  # the gateway may close while we still send
            for i in range(100):
                sock.sendall(b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000))
        answer = _read_until_closed(sock)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        assert b"headers_too_large" in answer
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
