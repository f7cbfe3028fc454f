"""The mirror's copy to the serving node (`controlplane.bundle.load._copy_mirror`): one archive of plain
files and directories, unpacked beside the served tree and swapped in only once complete.

The "serving node" is a directory here: the connection runs its commands with this machine's shell and
tar, and ``put`` is a file copy, so the archive, the unpack and the swap are the real ones.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from controlplane.bundle.load import _copy_mirror
from controlplane.errors import BundleError


@dataclass
class _Result:
    return_code: int
    stdout: str
    stderr: str


@dataclass
class LocalConn:
    """Runs what the load would run on the serving node in a local shell; keeps each archive it is sent."""

    sent: Path
    puts: list[Path] = field(default_factory=list)
    fail_put: bool = False
    corrupt_put: bool = False

    def run(self, command: str, *, hide: bool = False, warn: bool = False, **_: Any) -> _Result:
        argv = ["bash", "-c", command]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0 and not warn:
            raise RuntimeError(f"{command}: {proc.stderr}")
        return _Result(proc.returncode, proc.stdout, proc.stderr)

    def put(self, local: str, remote: str) -> None:
        if self.fail_put:
            raise EOFError("connection closed")
        kept = self.sent / f"put-{len(self.puts)}.tar"
        shutil.copyfile(local, kept)
        self.puts.append(kept)
        if self.corrupt_put:
            Path(remote).write_bytes(b"not a tar archive" * 100)
        else:
            shutil.copyfile(local, remote)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root``: a file's bytes, None for a directory."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")
    }


@pytest.fixture
def work(tmp_path: Path) -> Path:
    work = tmp_path / "unpacked"
    (work / "debs" / "pool" / "main").mkdir(parents=True)
    (work / "debs" / "pool" / "main" / "a_1.0_all.deb").write_bytes(b"deb-a" * 1000)
    (work / "debs" / "Release").write_text("Suite: bookworm\n")
    (work / "wheels").mkdir()
    (work / "wheels" / "x-1-py3-none-any.whl").write_bytes(b"wheel")
    (work / "models" / "tiny" / "none").mkdir(parents=True)
    (work / "models" / "tiny" / "none" / "weights.bin").write_bytes(bytes(range(256)) * 64)
    (work / "terraform").mkdir()
    provider = work / "terraform" / "terraform-provider-fake"
    provider.write_bytes(b"#!/bin/sh\n")
    provider.chmod(0o700)
    (work / ".sarv-bundle-work").write_text("mark\n")  # in work, not a mirror part: not carried
    return work


@pytest.fixture
def served(tmp_path: Path) -> Path:
    """The previous mirror, already served."""
    root = tmp_path / "srv" / "sarv-bundle"
    (root / "debs").mkdir(parents=True)
    (root / "debs" / "old.deb").write_bytes(b"old")
    return root


def _parts(work: Path) -> list[Path]:
    return [work / p for p in ("debs", "wheels", "models", "terraform")]


def _copy(conn: LocalConn, work: Path, root: Path) -> list[str]:
    said: list[str] = []
    _copy_mirror(conn, "node-1", work, _parts(work), PurePosixPath(root), say=said.append)  # type: ignore[arg-type]
    return said


def _leftovers(work: Path, root: Path) -> list[str]:
    """What a load leaves beside the served tree or in ``work`` besides the unpacked bundle."""
    beside = [p.name for p in root.parent.iterdir() if p.name != root.name]
    extra = [p.name for p in work.iterdir() if p.name not in {"debs", "wheels", "models", "terraform"}]
    return beside + [n for n in extra if n != ".sarv-bundle-work"]


def test_the_mirror_goes_as_one_archive_of_plain_entries_and_replaces_the_served_tree(
    work: Path, served: Path, tmp_path: Path
) -> None:
    conn = LocalConn(sent=tmp_path)
    said = _copy(conn, work, served)

    expected = {k: v for k, v in _tree(work).items() if not k.startswith(".sarv")}
    assert _tree(served) == expected  # the old deb is gone with the previous tree
    assert (served / "terraform" / "terraform-provider-fake").stat().st_mode & 0o111
    assert _leftovers(work, served) == []
    assert len(conn.puts) == 1
    with tarfile.open(conn.puts[0]) as tar:
        members = tar.getmembers()
    assert sorted(m.name for m in members if m.isfile()) == sorted(k for k, v in expected.items() if v)
    for m in members:
        assert m.isfile() or m.isdir(), m.name
        assert not m.name.startswith("/") and ".." not in PurePosixPath(m.name).parts, m.name
        assert (m.uid, m.gid, m.uname, m.gname) == (0, 0, "root", "root"), m.name
        assert not m.mode & 0o7022, (m.name, oct(m.mode))  # no set-id bits, nothing group/world-writable
    assert said[0] == "mirror: packing 5 files (0.0 MiB)"
    steps = [s.split(" (")[0] for s in said[1:]]
    assert steps == ["mirror: copying to node-1", "mirror: unpacking on node-1"]


@pytest.mark.parametrize("kind", ["symlink out", "fifo"])
def test_an_entry_that_is_not_a_plain_file_or_directory_is_refused_before_anything_is_sent(
    work: Path, served: Path, tmp_path: Path, kind: str
) -> None:
    odd = work / "models" / "tiny" / "none" / "odd"
    if kind == "symlink out":
        odd.symlink_to("/etc/passwd")
    else:
        subprocess.run(["mkfifo", str(odd)], check=True)
    before = _tree(served)
    conn = LocalConn(sent=tmp_path)
    with pytest.raises(BundleError, match=r"odd is neither a regular file nor a directory"):
        _copy(conn, work, served)
    assert conn.puts == []
    assert _tree(served) == before
    odd.unlink()
    assert _leftovers(work, served) == []


@pytest.mark.parametrize("failure", ["unpack", "connection"])
def test_a_failed_copy_keeps_the_previous_mirror_and_removes_the_partial_one(
    work: Path, served: Path, tmp_path: Path, failure: str
) -> None:
    before = _tree(served)
    if failure == "unpack":
        conn = LocalConn(sent=tmp_path, corrupt_put=True)
        with pytest.raises(BundleError, match=r"host node-1: unpacking the mirror failed"):
            _copy(conn, work, served)
    else:
        conn = LocalConn(sent=tmp_path, fail_put=True)
        with pytest.raises(EOFError):
            _copy(conn, work, served)
    assert _tree(served) == before
    assert _leftovers(work, served) == []
