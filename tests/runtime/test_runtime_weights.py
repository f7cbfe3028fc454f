"""Weights land in the model cache only after every file matched its sha256 manifest."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.errors import WeightsError
from controlplane.weights import (
    MANIFEST_NAME,
    WeightsPolicy,
    ensure_weights,
    read_manifest,
    verify_dir,
    write_manifest,
)


def _model_dir(tmp_path: Path, files: dict[str, bytes] | None = None) -> Path:
    src = tmp_path / "src"
    src.mkdir(parents=True)
    for name, data in (files or {"model.safetensors": b"\x01" * 1000, "config.json": b'{"a": 1}'}).items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    write_manifest(src)
    return src


def test_manifest_is_sha256sum_format(tmp_path: Path) -> None:
    src = _model_dir(tmp_path)
    lines = (src / MANIFEST_NAME).read_text().splitlines()
    digest = hashlib.sha256(b'{"a": 1}').hexdigest()
    assert lines[0] == f"{digest}  config.json"
    assert read_manifest(src)["config.json"] == digest


def test_local_source_lands_verified_and_is_shared(tmp_path: Path) -> None:
    src = _model_dir(tmp_path)
    cache = tmp_path / "cache"
    first = ensure_weights(str(src), "m", cache)
    assert first.parent == cache / "m"
    assert (first / "model.safetensors").read_bytes() == b"\x01" * 1000
    verify_dir(first)
    # A second replica on the same node reuses the same directory.
    assert ensure_weights(str(src), "m", cache) == first
    assert [p.name for p in (cache / "m").iterdir()] == [first.name]


def test_hash_mismatch_names_the_file_and_both_hashes(tmp_path: Path) -> None:
    src = _model_dir(tmp_path)
    expected = read_manifest(src)["model.safetensors"]
    (src / "model.safetensors").write_bytes(b"\x02" * 1000)
    actual = hashlib.sha256(b"\x02" * 1000).hexdigest()
    cache = tmp_path / "cache"
    with pytest.raises(WeightsError) as err:
        ensure_weights(str(src), "m", cache)
    assert "model.safetensors" in str(err.value)
    assert expected in str(err.value)
    assert actual in str(err.value)
    # Nothing half-landed: no model directory and no temporary directory is left behind.
    assert list((cache / "m").iterdir()) == []


def test_tampering_in_the_cache_is_caught_before_reuse(tmp_path: Path) -> None:
    src = _model_dir(tmp_path)
    cache = tmp_path / "cache"
    landed = ensure_weights(str(src), "m", cache)
    (landed / "model.safetensors").write_bytes(b"\x03" * 1000)
    with pytest.raises(WeightsError, match="does not match the manifest"):
        ensure_weights(str(src), "m", cache)


def test_missing_source_and_manifest(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="not a directory"):
        ensure_weights(str(tmp_path / "nope"), "m", tmp_path / "cache")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes(b"x")
    with pytest.raises(WeightsError, match="no SHA256SUMS manifest"):
        ensure_weights(str(bare), "m", tmp_path / "cache")


def test_file_listed_but_missing(tmp_path: Path) -> None:
    src = _model_dir(tmp_path)
    (src / "config.json").unlink()
    with pytest.raises(WeightsError, match="listed in the manifest but missing"):
        ensure_weights(str(src), "m", tmp_path / "cache")


def test_pickle_weights_refused_unless_allowed(tmp_path: Path) -> None:
    src = _model_dir(tmp_path, {"pytorch_model.bin": b"pickle", "config.json": b"{}"})
    with pytest.raises(WeightsError, match="pickle"):
        ensure_weights(str(src), "m", tmp_path / "cache")
    landed = ensure_weights(str(src), "m", tmp_path / "cache", policy=WeightsPolicy(allow_pickle=True))
    assert (landed / "pytorch_model.bin").is_file()


def test_remote_code_refused_unless_trusted(tmp_path: Path) -> None:
    src = _model_dir(tmp_path, {"model.safetensors": b"w", "modeling_x.py": b"import os"})
    with pytest.raises(WeightsError, match=r"modeling_x\.py"):
        ensure_weights(str(src), "m", tmp_path / "cache")
    auto = tmp_path / "auto"
    shutil.copytree(_model_dir(tmp_path / "a", {"model.safetensors": b"w", "config.json": b"{}"}), auto)
    (auto / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "x.Y"}}))
    write_manifest(auto)
    with pytest.raises(WeightsError, match="auto_map"):
        ensure_weights(str(auto), "m", tmp_path / "cache")
    ok = ensure_weights(str(auto), "m", tmp_path / "cache", policy=WeightsPolicy(trust_remote_code=True))
    assert (ok / "config.json").is_file()


def test_manifest_entries_cannot_escape_the_model(tmp_path: Path) -> None:
    src = _model_dir(tmp_path)
    (src / MANIFEST_NAME).write_text("0" * 64 + "  ../etc/passwd\n")
    with pytest.raises(WeightsError, match="refusing manifest entry"):
        ensure_weights(str(src), "m", tmp_path / "cache")


@pytest.fixture
def http_dir(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real HTTP server on loopback serving a model directory."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))

    class Quiet(handler.func):  # type: ignore[name-defined,misc]
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_http_source_is_fetched_and_verified(tmp_path: Path, http_dir: tuple[str, Path]) -> None:
    url, root = http_dir
    shutil.copytree(_model_dir(tmp_path), root / "m1")
    landed = ensure_weights(f"{url}/m1", "m", tmp_path / "cache")
    assert (landed / "model.safetensors").read_bytes() == b"\x01" * 1000
    verify_dir(landed)


def test_http_source_with_a_corrupt_file(tmp_path: Path, http_dir: tuple[str, Path]) -> None:
    url, root = http_dir
    shutil.copytree(_model_dir(tmp_path), root / "m1")
    (root / "m1" / "config.json").write_bytes(b'{"a": 2}')
    with pytest.raises(WeightsError, match=r"config.json: sha256 [0-9a-f]{64} does not match"):
        ensure_weights(f"{url}/m1", "m", tmp_path / "cache")


def test_http_source_without_manifest(tmp_path: Path, http_dir: tuple[str, Path]) -> None:
    url, _ = http_dir
    with pytest.raises(WeightsError, match="HTTP 404"):
        ensure_weights(f"{url}/missing", "m", tmp_path / "cache")
