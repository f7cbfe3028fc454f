"""The bundle manifest (every file with its sha256 and size), its SSH signature, and verification.

A bundle is an uncompressed tar: ``manifest.json``, ``manifest.json.sig`` (``ssh-keygen -Y sign``,
namespace ``sarv-bundle``) and the files the manifest lists that are not in its base bundle. A file
marked ``in_base`` is carried by the bundle named in ``base`` (an incremental bundle, ``--since``).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.errors import BundleError, ConfigError, describe_validation_error

__all__ = [
    "MANIFEST",
    "NAMESPACE",
    "SIGNATURE",
    "BaseRef",
    "FileEntry",
    "Manifest",
    "check_signature",
    "manifest_digest",
    "open_bundle",
    "sign_manifest",
    "verify_bundle",
]

MANIFEST = "manifest.json"
SIGNATURE = "manifest.json.sig"
NAMESPACE = "sarv-bundle"
_CHUNK = 1 << 20

Progress = Callable[[str], None]


class FileEntry(BaseModel):
    """One file of the bundle."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1)
    """Relative POSIX path inside the bundle (``wheels/…``, ``debs/…``, ``images/…``, ``models/…``)."""
    part: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=0)
    in_base: bool = False
    """The file is carried by the base bundle (same path and hash), not by this one."""


class BaseRef(BaseModel):
    """The bundle an incremental bundle builds on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """File name of the base bundle (``load`` looks for it next to this one unless given ``--base``)."""
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    """What a bundle holds and for which site."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(default=1, ge=1, le=1)
    created: str
    python: str
    """The fleet's Python of the wheelhouse (``3.11``)."""
    release: str
    """The OS release of the package repository (``bookworm``)."""
    parts: dict[str, dict[str, str]] = Field(default_factory=dict)
    """Per part, what it holds beyond its files (image references and ids, models, why a part is empty)."""
    files: list[FileEntry] = Field(default_factory=list)
    base: BaseRef | None = None

    def by_part(self, part: str) -> list[FileEntry]:
        return [f for f in self.files if f.part == part]

    def dumps(self) -> bytes:
        return (json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def loads(cls, data: bytes, where: str) -> Manifest:
        try:
            manifest = cls.model_validate_json(data)
        except ValidationError as exc:
            raise BundleError(f"{where}: {describe_validation_error(exc, what='manifest')}") from None
        for entry in manifest.files:
            p = PurePosixPath(entry.path)
            if p.is_absolute() or ".." in p.parts or entry.path in {MANIFEST, SIGNATURE}:
                raise BundleError(f"{where}: refusing manifest entry {entry.path!r} (outside the bundle)")
        return manifest


def manifest_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _ssh_keygen(argv: list[str], *, stdin: bytes, what: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(
            ["ssh-keygen", *argv], input=stdin, capture_output=True, timeout=60, check=False
        )
    except FileNotFoundError:
        raise ConfigError(
            f"cannot {what}: ssh-keygen is not installed", hint="apt-get install openssh-client"
        ) from None


def sign_manifest(data: bytes, key: Path) -> bytes:
    """An SSH signature of ``data`` with the private ``key`` (``ssh-keygen -Y sign``)."""
    if not key.is_file():
        raise ConfigError(
            f"signing key {key} does not exist",
            hint="give --sign-key a private SSH key (ssh-keygen -t ed25519 -f KEY makes one)",
        )
    with tempfile.TemporaryDirectory(prefix="sarv-sign-") as tmp:
        msg = Path(tmp) / MANIFEST
        msg.write_bytes(data)
        res = _ssh_keygen(
            ["-Y", "sign", "-q", "-f", str(key), "-n", NAMESPACE, str(msg)], stdin=b"", what="sign"
        )
        sig = msg.with_name(SIGNATURE)
        if res.returncode != 0 or not sig.is_file():
            raise ConfigError(f"cannot sign the manifest with {key}: {res.stderr.decode().strip()}")
        return sig.read_bytes()


def check_signature(data: bytes, signature: bytes, allowed_signers: Path, where: str) -> str:
    """The principal whose key signed ``data``, from ``allowed_signers``; :class:`BundleError` otherwise."""
    if not allowed_signers.is_file():
        raise ConfigError(
            f"allowed signers file {allowed_signers} does not exist",
            hint="give --allowed-signers a file of 'PRINCIPAL ssh-ed25519 KEY' lines (ssh-keygen(1))",
        )
    with tempfile.TemporaryDirectory(prefix="sarv-verify-") as tmp:
        sig = Path(tmp) / SIGNATURE
        sig.write_bytes(signature)
        found = _ssh_keygen(
            ["-Y", "find-principals", "-s", str(sig), "-f", str(allowed_signers)], stdin=b"", what="verify"
        )
        principal = found.stdout.decode().strip().splitlines()[0] if found.returncode == 0 else ""
        if not principal:
            raise BundleError(
                f"{where}: the manifest's signature is not by a key in {allowed_signers}",
                hint="the bundle was signed by someone else, or the signature was replaced; load nothing",
            )
        res = _ssh_keygen(
            ["-Y", "verify", "-f", str(allowed_signers), "-I", principal, "-n", NAMESPACE, "-s", str(sig)],
            stdin=data,
            what="verify",
        )
    if res.returncode != 0:
        raise BundleError(
            f"{where}: bad signature on the manifest "
            f"({res.stderr.decode().strip() or 'verification failed'})",
            hint="the manifest was changed after signing; load nothing",
        )
    return principal


def _hash_stream(fh: IO[bytes] | None) -> str:
    h = hashlib.sha256()
    if fh is not None:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def open_bundle(path: Path) -> tuple[Manifest, bytes, bytes]:
    """The manifest (parsed and raw) and signature of the bundle file at ``path``."""
    if not path.is_file():
        raise ConfigError(f"bundle {path} does not exist")
    try:
        with tarfile.open(path, "r:") as tar:
            raw = _member_bytes(tar, MANIFEST, path)
            sig = _member_bytes(tar, SIGNATURE, path)
    except (tarfile.TarError, OSError) as exc:
        raise BundleError(f"{path} is not a bundle (an uncompressed tar): {exc}") from None
    return Manifest.loads(raw, str(path)), raw, sig


def _member_bytes(tar: tarfile.TarFile, name: str, path: Path) -> bytes:
    try:
        fh = tar.extractfile(name)
    except KeyError:
        fh = None
    if fh is None:
        raise BundleError(f"{path} has no {name}", hint="it was not written by `llmctl bundle create`")
    return fh.read()


def _iter_members(path: Path) -> Iterator[tuple[tarfile.TarInfo, tarfile.TarFile]]:
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            yield member, tar


def verify_bundle(
    path: Path,
    allowed_signers: Path,
    *,
    base: Path | None = None,
    extract_to: Path | None = None,
    progress: Progress | None = None,
) -> Manifest:
    """Check the signature and every file's hash (and the base bundle's, for an incremental one).

    With ``extract_to``, the files are written there as they are hashed (a base bundle's files too), and
    the directory is only usable when this returns. Raises :class:`BundleError` naming each file that
    differs with both hashes, each file missing and each file not in the manifest.
    """
    manifest, raw, sig = open_bundle(path)
    check_signature(raw, sig, allowed_signers, str(path))
    problems: list[str] = []
    own = {f.path: f for f in manifest.files if not f.in_base}
    problems += _check_members(path, own, extract_to, progress, strict=True)
    inherited = {f.path: f for f in manifest.files if f.in_base}
    if manifest.base is not None:
        base_path = base or path.with_name(manifest.base.name)
        if not base_path.is_file():
            raise BundleError(
                f"{path} is incremental on {manifest.base.name}, which is not at {base_path}",
                hint="put the base bundle next to it or pass --base FILE",
            )
        _, base_raw, base_sig = open_bundle(base_path)
        if manifest_digest(base_raw) != manifest.base.manifest_sha256:
            raise BundleError(
                f"{base_path} is not the base {path.name} was built on "
                f"(manifest sha256 {manifest_digest(base_raw)}, expected {manifest.base.manifest_sha256})"
            )
        check_signature(base_raw, base_sig, allowed_signers, str(base_path))
        problems += _check_members(base_path, inherited, extract_to, progress, strict=False)
    elif inherited:
        problems.append(f"{len(inherited)} files are marked in_base but the manifest names no base")
    if problems:
        raise BundleError(
            f"{path}: {len(problems)} problem(s): " + "; ".join(problems),
            hint="the bundle was changed or damaged after signing; load nothing and rebuild or re-copy it",
        )
    return manifest


def _check_members(
    path: Path,
    expected: dict[str, FileEntry],
    extract_to: Path | None,
    progress: Progress | None,
    *,
    strict: bool,
) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    done = 0
    for member, tar in _iter_members(path):
        if member.name in {MANIFEST, SIGNATURE} or member.isdir():
            continue
        entry = expected.get(member.name)
        if entry is None:
            if strict:
                problems.append(f"{member.name} is in the bundle but not in the manifest")
            continue
        if not member.isfile():
            problems.append(f"{member.name} is not a regular file")
            continue
        seen.add(member.name)
        done += 1
        if progress:
            progress(f"verify: {member.name} ({done}/{len(expected)})")
        fh = tar.extractfile(member)
        if extract_to is None:
            actual = _hash_stream(fh)
        else:
            target = extract_to / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            with target.open("wb") as out:
                while fh is not None and (chunk := fh.read(_CHUNK)):
                    h.update(chunk)
                    out.write(chunk)
            actual = h.hexdigest()
        if actual != entry.sha256:
            problems.append(f"{member.name}: sha256 {actual} does not match the manifest's {entry.sha256}")
    problems += [f"{name}: listed in the manifest but missing" for name in sorted(set(expected) - seen)]
    return problems
