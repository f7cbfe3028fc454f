"""``llmctl gateway`` over TLS (reload on SIGHUP, client certificates) and its separate metrics listener.

Real processes, real TLS clients (``ssl``, httpx) and certificates from a throwaway CA made by openssl.
With ``--workers 2`` (on a real Redis) a connection's worker is the child process holding its server-side
socket (``/proc``), so the test knows when every worker has answered.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fixtures.common import free_port
from fixtures.gateway import gateway_process
from fixtures.redis import TlsFiles, make_tls_files

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, TlsFiles, Path]:
    """Two CAs with a 127.0.0.1 server and a client certificate each, and a bundle trusting both."""
    first = make_tls_files(tmp_path_factory.mktemp("pki-a"))
    second = make_tls_files(tmp_path_factory.mktemp("pki-b"))
    bundle = tmp_path_factory.mktemp("bundle") / "cas.pem"
    bundle.write_text(first.ca.read_text() + second.ca.read_text())
    return first, second, bundle


def _install(src: TlsFiles, cert: Path, key: Path) -> None:
    shutil.copyfile(src.server_cert, cert)
    shutil.copyfile(src.server_key, key)
    key.chmod(0o600)


def _trust(cafile: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cafile))


def _peer_cert(port: int, cafile: Path) -> bytes:
    ctx = _trust(cafile)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def test_https_and_a_new_certificate_on_sighup_without_dropping_the_listener(tmp_path, pki) -> None:
    first, second, bundle = pki
    cert, key = tmp_path / "gw.crt", tmp_path / "gw.key"
    _install(first, cert, key)
    with (
        gateway_process(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key)) as (port, proc),
        httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=_trust(bundle), timeout=10) as client,
    ):
        assert client.get("/health").status_code == 200  # a kept-alive connection, opened before the reload
        assert _peer_cert(port, bundle) == _der(first.server_cert)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP is not served

        _install(second, cert, key)
        proc.send_signal(signal.SIGHUP)
        seen = b""
        for _ in range(200):  # bounded: the handler runs on the gateway's next loop iteration
            seen = _peer_cert(port, bundle)
            if seen == _der(second.server_cert):
                break
        assert seen == _der(second.server_cert)
        assert client.get("/health").status_code == 200
        assert proc.poll() is None

        # A broken pair on the next SIGHUP: logged, the current certificate kept, still serving.
        cert.write_text("not a certificate\n")
        proc.send_signal(signal.SIGHUP)
        for _ in range(20):
            assert _peer_cert(port, bundle) == _der(second.server_cert)
        assert proc.poll() is None


def test_client_certificate_mode_refuses_callers_without_one(tmp_path, pki) -> None:
    first, _, _ = pki
    args = ("--tls-cert", str(first.server_cert), "--tls-key", str(first.server_key))
    with gateway_process(tmp_path, *args, "--tls-client-ca", str(first.ca)) as (port, _):
        url = f"https://127.0.0.1:{port}/health"
        with pytest.raises(httpx.TransportError):
            httpx.get(url, verify=_trust(first.ca), timeout=5)
        ctx = _trust(first.ca)
        ctx.load_cert_chain(first.client_cert, first.client_key)
        assert httpx.get(url, verify=ctx, timeout=5).status_code == 200
        # A certificate from another CA is refused too.
        _, other, _ = pki
        foreign = _trust(first.ca)
        foreign.load_cert_chain(other.client_cert, other.client_key)
        with pytest.raises(httpx.TransportError):
            httpx.get(url, verify=foreign, timeout=5)


def _llmctl(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if not (home / "absent.yaml").exists():
        (home / "absent.yaml").write_text("{}\n")
    env = {
        "SARV_HOME": str(home),
        "SARV_STATE_URL": f"sqlite:///{home / 'state.db'}",
        "SARV_CONFIG": str(home / "absent.yaml"),
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli.main", "gateway", "--port", str(free_port()), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("which", "fragment"),
    [
        ("cert", "does not exist"),
        ("key", "does not exist"),
        ("mismatch", "cannot load the TLS certificate"),
        ("only-cert", "gateway_tls_key (--tls-key) is not set"),
        ("ca-alone", "gateway_tls_client_ca needs TLS"),
    ],
)
def test_a_bad_certificate_or_key_is_a_one_line_error_at_start(tmp_path, pki, which, fragment) -> None:
    first, second, _ = pki
    cert, key = str(first.server_cert), str(first.server_key)
    args = {
        "cert": ["--tls-cert", str(tmp_path / "missing.crt"), "--tls-key", key],
        "key": ["--tls-cert", cert, "--tls-key", str(tmp_path / "missing.key")],
        "mismatch": ["--tls-cert", cert, "--tls-key", str(second.server_key)],
        "only-cert": ["--tls-cert", cert],
        "ca-alone": ["--tls-client-ca", str(first.ca)],
    }[which]
    out = _llmctl(tmp_path, *args)
    assert out.returncode == 2, out.stderr
    assert fragment in out.stderr
    assert "Traceback" not in out.stderr
    assert len([line for line in out.stderr.splitlines() if line.strip()]) == 1, out.stderr


def test_metrics_are_on_their_own_listener_not_the_api_port(tmp_path) -> None:
    metrics = free_port()
    with gateway_process(tmp_path, "--metrics-port", str(metrics)) as (port, _):
        api = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert api.status_code == 404
        err = api.json()["error"]
        assert "/metrics" in err["message"] and err["type"] == "not_found_error"
        text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5)
        assert text.status_code == 200 and "sarv_gateway_replicas" in text.text
        assert text.headers["content-type"].startswith("text/plain")
        other = httpx.get(f"http://127.0.0.1:{metrics}/v1/models", timeout=5)
        assert other.status_code == 404 and "/v1/models" in other.json()["error"]["message"]


def test_the_metrics_token_is_required_when_set(tmp_path) -> None:
    token_file = tmp_path / "metrics.token"
    token_file.write_text("metrics-Token-0123456789abcdef\n")
    metrics = free_port()
    env = {"SARV_GATEWAY_METRICS_TOKEN_FILE": str(token_file)}
    with gateway_process(tmp_path, "--metrics-port", str(metrics), env=env) as (_, proc):
        url = f"http://127.0.0.1:{metrics}/metrics"
        refused = httpx.get(url, timeout=5)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 401
        good = httpx.get(url, headers={"Authorization": "Bearer metrics-Token-0123456789abcdef"}, timeout=5)
        assert good.status_code == 200
    assert proc.stderr is not None


def test_a_short_metrics_token_or_a_taken_metrics_port_is_a_one_line_error(tmp_path) -> None:
    short = tmp_path / "short.token"
    short.write_text("abc\n")
    home = tmp_path / "h"
    home.mkdir()
    (home / "absent.yaml").write_text(json.dumps({"gateway_metrics_token_file": str(short)}))
    out = _llmctl(home)
    assert out.returncode == 2 and "use at least 16" in out.stderr and "Traceback" not in out.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        out = _llmctl(tmp_path, "--metrics-port", str(busy))
    assert out.returncode != 0
    assert f"cannot listen for metrics on 127.0.0.1:{busy}" in out.stderr
    assert "Traceback" not in out.stderr


# --- several workers: ``--workers 2`` (Redis state), one SIGHUP to the main process


def _children(pid: int) -> set[int]:
    """Process ids whose parent is ``pid`` (from /proc)."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                # the fields after the command name, which may hold spaces: state, ppid, …
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(entry.name))
    return found


def _worker_of(conn: socket.socket, main: int) -> int:
    """The gateway worker that accepted ``conn``: the child of ``main`` holding its server-side socket."""
    port, peer = conn.getpeername()[1], conn.getsockname()[1]
    wanted = (f"0100007F:{port:04X}", f"0100007F:{peer:04X}")  # /proc/net/tcp: local, remote
    inode = next(
        (
            fields[9]
            for fields in (line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:])
            if (fields[1], fields[2]) == wanted
        ),
        None,
    )
    assert inode is not None, f"no server-side socket for the connection from port {peer}"
    for pid in _children(main):
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == f"socket:[{inode}]":
                        return pid
    raise AssertionError(f"no child of {main} holds the connection from port {peer}")


def _answer(conn: ssl.SSLSocket, main: int) -> tuple[int, bytes]:
    """(worker, certificate) of a fresh connection's handshake."""
    der = conn.getpeercert(binary_form=True)
    assert der is not None
    return _worker_of(conn, main), der


def _fresh(port: int, cafile: Path, main: int) -> tuple[int, bytes]:
    ctx = _trust(cafile)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        return _answer(tls, main)


def _get_health(conn: ssl.SSLSocket) -> bytes:
    """One keep-alive ``GET /health`` on an open connection; its status line (b"" if it was closed)."""
    conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head and len(head) < 65536:
        chunk = conn.recv(4096)
        if not chunk:
            return b""
        head += chunk
    headers, _, body = head.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in headers.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = conn.recv(4096)
        if not chunk:
            return b""
        body += chunk
    return headers.split(b"\r\n", 1)[0]


def _each_worker(port: int, cafile: Path, main: int, workers: int, want: bytes) -> dict[int, bytes]:
    """Fresh connections until ``workers`` distinct live workers have answered, each last with ``want``
    (bounded in count and time); each live worker's last certificate."""
    seen: dict[int, bytes] = {}
    deadline = time.monotonic() + 60
    for _ in range(5000):
        worker, der = _fresh(port, cafile, main)
        seen[worker] = der
        live = _children(main)
        seen = {w: d for w, d in seen.items() if w in live}
        if (len(seen) >= workers and set(seen.values()) == {want}) or time.monotonic() > deadline:
            break
    return seen


class _Log:
    """What a running process has written to its stderr pipe so far, read without blocking."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        self._pipe = proc.stderr
        os.set_blocking(self._pipe.fileno(), False)
        self._seen = b""

    def text(self) -> str:
        with contextlib.suppress(BlockingIOError):
            while chunk := self._pipe.read(65536):
                self._seen += chunk
        return self._seen.decode(errors="replace")


@pytest.mark.redis
def test_sighup_reloads_every_worker_and_keeps_open_connections(tmp_path, pki, redis_url) -> None:
    first, second, bundle = pki
    cert, key = tmp_path / "gw.crt", tmp_path / "gw.key"
    _install(first, cert, key)
    args = ("--workers", "2", "--tls-cert", str(cert), "--tls-key", str(key))
    with gateway_process(tmp_path, *args, env={"SARV_STATE_URL": redis_url}) as (port, proc):
        log = _Log(proc)
        ctx = _trust(bundle)
        with (
            socket.create_connection(("127.0.0.1", port), timeout=30) as raw,
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as kept,
        ):
            assert _get_health(kept) == b"HTTP/1.1 200 OK"  # opened before the reload, kept alive
            kept_worker, kept_cert = _answer(kept, proc.pid)
            assert kept_cert == _der(first.server_cert)
            before = _each_worker(port, bundle, proc.pid, 2, _der(first.server_cert))
            assert len(before) == 2 and kept_worker in before, before.keys()
            assert set(before.values()) == {_der(first.server_cert)}

            _install(second, cert, key)
            proc.send_signal(signal.SIGHUP)
            after = _each_worker(port, bundle, proc.pid, 2, _der(second.server_cert))
            assert set(after.values()) == {_der(second.server_cert)}, (
                f"every worker serves the new certificate\n{log.text()}"
            )
            assert len(after) == 2
            assert set(after) == set(before), "the same workers, reloaded in place"
            for _ in range(20):  # and none goes back to the old one
                assert _fresh(port, bundle, proc.pid)[1] == _der(second.server_cert)
            # The connection opened before the reload is still up (within the 30 s keep-alive), on its
            # old certificate.
            assert _get_health(kept) == b"HTTP/1.1 200 OK"
            assert kept.getpeercert(binary_form=True) == _der(first.server_cert)

            # A broken pair on the next SIGHUP: refused and logged by every worker, the certificate kept.
            cert.write_text("not a certificate\n")
            proc.send_signal(signal.SIGHUP)
            for _ in range(400):  # bounded; each try is a fresh handshake, which paces the loop
                if log.text().count("TLS reload failed, keeping the current certificate") >= 2:
                    break
                assert _fresh(port, bundle, proc.pid)[1] == _der(second.server_cert)
            assert log.text().count("TLS reload failed, keeping the current certificate") == 2, log.text()
            assert "not a certificate" not in log.text()  # the file's content is not logged
            kept_after = _each_worker(port, bundle, proc.pid, 2, _der(second.server_cert))
            assert kept_after == after, "the same workers, still on the new certificate"
            assert _get_health(kept) == b"HTTP/1.1 200 OK"
            assert proc.poll() is None
