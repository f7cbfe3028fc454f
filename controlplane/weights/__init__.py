"""Model weights: fetch a source into the node's model cache and verify it against its sha256 manifest.

A source is a local directory or an ``http(s)://`` / ``s3://`` URL of a directory; either holds a
``SHA256SUMS`` manifest in ``sha256sum`` format (``cd DIR && sha256sum * > SHA256SUMS`` writes one).
Weights land in ``<cache>/<model>/<manifest digest>/``: replicas of the same model and manifest on one
node share that directory, and nothing starts from a file whose hash was not checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import IO, cast

from pydantic import BaseModel, ConfigDict

from controlplane.errors import WeightsError

__all__ = [
    "MANIFEST_NAME",
    "WeightsPolicy",
    "cache_digest",
    "ensure_weights",
    "read_manifest",
    "read_source_json",
    "sha256_file",
    "verify_dir",
    "write_manifest",
]

MANIFEST_NAME = "SHA256SUMS"
_STAMP_NAME = ".sarv-verified.json"
_CHUNK = 1 << 20
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
# Formats that can execute code when loaded (pickle); refused unless explicitly allowed.
_PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt"}

Progress = Callable[[str], None]


class WeightsPolicy(BaseModel):
    """What a deployment explicitly allows beyond safetensors-only, no-remote-code weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow_pickle: bool = False
    """Accept pickle-based weight files (``.bin``, ``.pt`` …), which can run code when loaded."""
    trust_remote_code: bool = False
    """Accept Python files and ``auto_map`` entries that make the engine import model code."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _manifest_text(entries: dict[str, str]) -> str:
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(entries.items()))


def cache_digest(entries: dict[str, str]) -> str:
    """The name of a verified copy's directory in a model cache (``<cache>/<model>/<digest>``)."""
    return hashlib.sha256(_manifest_text(entries).encode()).hexdigest()[:16]


def write_manifest(directory: Path) -> dict[str, str]:
    """Hash every file under ``directory`` (except the manifest itself) into ``SHA256SUMS``."""
    entries: dict[str, str] = {}
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if path.is_file() and rel not in {MANIFEST_NAME, _STAMP_NAME}:
            entries[rel] = sha256_file(path)
    (directory / MANIFEST_NAME).write_text(_manifest_text(entries))
    return entries


def _safe_relpath(name: str, where: str) -> str:
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or name in {MANIFEST_NAME, _STAMP_NAME}:
        raise WeightsError(
            f"{where}: refusing manifest entry {name!r} (must be a relative path inside the model)"
        )
    return p.as_posix()


def parse_manifest(text: str, where: str) -> dict[str, str]:
    """Parse ``sha256sum`` output (``HEX  NAME`` or ``HEX *NAME`` per line)."""
    entries: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        digest, _, name = line.partition(" ")
        name = name.strip().removeprefix("*")
        digest = digest.lower()
        if not _HEX64.match(digest) or not name:
            raise WeightsError(f"{where} line {lineno}: expected '<sha256 hex>  <file name>', got {raw!r}")
        entries[_safe_relpath(name, where)] = digest
    if not entries:
        raise WeightsError(f"{where} lists no files; regenerate it with `sha256sum * > {MANIFEST_NAME}`")
    return entries


def read_manifest(directory: Path) -> dict[str, str]:
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise WeightsError(
            f"{directory} has no {MANIFEST_NAME} manifest",
            hint=f"create one with `cd {directory} && sha256sum * > {MANIFEST_NAME}`",
        )
    return parse_manifest(path.read_text(), str(path))


def _check_policy(entries: dict[str, str], policy: WeightsPolicy, where: str) -> None:
    names = list(entries)
    pickles = [n for n in names if PurePosixPath(n).suffix.lower() in _PICKLE_SUFFIXES]
    if pickles and not policy.allow_pickle:
        raise WeightsError(
            f"{where}: {pickles[0]} is a pickle-based weight file, which can run code when loaded",
            hint="convert it to safetensors, or deploy with --engine-arg allow_pickle_weights=true",
        )
    code = [n for n in names if n.endswith(".py")]
    if code and not policy.trust_remote_code:
        raise WeightsError(
            f"{where}: {code[0]} is model code the engine would import",
            hint="remove it, or deploy with --engine-arg trust_remote_code=true if you trust its author",
        )
    if not any(n.endswith(".safetensors") for n in names) and not pickles:
        raise WeightsError(f"{where}: the manifest lists no .safetensors weight files")


def _check_config(directory: Path, policy: WeightsPolicy) -> None:
    """Refuse ``auto_map``: transformers imports remote code through it (a past vLLM CVE)."""
    cfg = directory / "config.json"
    if policy.trust_remote_code or not cfg.is_file():
        return
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{cfg} is not valid JSON: {exc}") from None
    if isinstance(data, dict) and data.get("auto_map"):
        raise WeightsError(
            f"{cfg} has an auto_map entry that loads model code",
            hint="deploy with --engine-arg trust_remote_code=true if you trust its author",
        )


def _mismatch(name: str, expected: str, actual: str) -> WeightsError:
    return WeightsError(
        f"{name}: sha256 {actual} does not match the manifest's {expected}",
        hint="the file is corrupt or the manifest is stale; nothing was started",
    )


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def verify_dir(directory: Path, entries: dict[str, str] | None = None) -> dict[str, str]:
    """Hash every manifest entry of ``directory``; raise :class:`WeightsError` on the first difference."""
    entries = entries if entries is not None else read_manifest(directory)
    for name, expected in entries.items():
        path = directory / name
        if not path.is_file():
            raise WeightsError(f"{path}: listed in the manifest but missing")
        actual = sha256_file(path)
        if actual != expected:
            raise _mismatch(name, expected, actual)
    return entries


def _stamp(directory: Path, entries: dict[str, str]) -> None:
    stamp = {name: _stat_key(directory / name) for name in entries}
    (directory / _STAMP_NAME).write_text(json.dumps(stamp, sort_keys=True))


def _stamp_valid(directory: Path, entries: dict[str, str]) -> bool:
    """True when no file changed since it was hashed (size and mtime), so a re-hash can be skipped."""
    try:
        stamp = json.loads((directory / _STAMP_NAME).read_text())
        return all(stamp.get(name) == _stat_key(directory / name) for name in entries)
    except (OSError, ValueError):
        return False


def _copy_hashing(src: IO[bytes], dst: Path) -> str:
    h = hashlib.sha256()
    with dst.open("wb") as out:
        while chunk := src.read(_CHUNK):
            h.update(chunk)
            out.write(chunk)
    return h.hexdigest()


def _http_base(source: str) -> str:
    if source.startswith("s3://"):
        # S3-compatible stores (MinIO, Ceph RGW) in path style; requests are unsigned, so the bucket
        # must allow anonymous reads from the cluster network (or use a pre-signed http(s) URL).
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if not endpoint:
            raise WeightsError(
                f"cannot fetch {source}: no S3 endpoint",
                hint="set AWS_ENDPOINT_URL to your S3-compatible store, e.g. http://minio.internal:9000",
            )
        return endpoint.rstrip("/") + "/" + source.removeprefix("s3://").strip("/")
    return source.rstrip("/")


@contextmanager
def _http_body(url: str, timeout: float) -> Iterator[IO[bytes]]:
    """A streamed GET of ``url`` as a file-like object; any failure is a :class:`WeightsError`."""
    import httpx

    class _Body:
        def __init__(self, chunks: Iterator[bytes]) -> None:
            self._chunks = chunks

        def read(self, _n: int = -1) -> bytes:
            return next(self._chunks, b"")

    try:
        with httpx.stream("GET", url, timeout=timeout, follow_redirects=True) as resp:
            if resp.status_code != 200:
                raise WeightsError(f"GET {url} answered HTTP {resp.status_code}")
            yield cast(IO[bytes], _Body(resp.iter_bytes(_CHUNK)))
    except httpx.HTTPError as exc:
        raise WeightsError(f"cannot fetch {url}: {exc}") from None


def _land(
    fetch: Callable[[str, Path], str], entries: dict[str, str], dest: Path, progress: Progress | None
) -> None:
    """Fetch every entry into a temporary sibling of ``dest``, verify, then rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for i, (name, expected) in enumerate(sorted(entries.items()), 1):
            if progress:
                progress(f"weights: {name} ({i}/{len(entries)})")
            target = work / name
            target.parent.mkdir(parents=True, exist_ok=True)
            actual = fetch(name, target)
            if actual != expected:
                raise _mismatch(name, expected, actual)
        (work / MANIFEST_NAME).write_text(_manifest_text(entries))
        _stamp(work, entries)
        # mkdtemp creates 0700; engines may run as another user (containers). Weights are not secret.
        os.chmod(work, 0o755)  # noqa: S103
        try:
            work.rename(dest)
        except OSError:
            # Another deploy landed the same manifest first: theirs is verified too, keep it.
            if not (dest / _STAMP_NAME).is_file():
                raise
            shutil.rmtree(work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def read_source_json(
    source: str, name: str = "config.json", *, timeout: float = 60.0
) -> dict[str, object] | None:
    """One JSON file of ``source`` (a directory or an http(s)/s3 URL), read without copying anything;
    None when the source has no such file."""
    if source.startswith(("http://", "https://", "s3://")):
        url = f"{_http_base(source)}/{name}"
        try:
            with _http_body(url, timeout) as body:
                text = b"".join(iter(body.read, b"")).decode(errors="replace")
        except WeightsError as exc:
            if "HTTP 404" in str(exc):
                return None
            raise
        where = url
    else:
        path = Path(source).expanduser() / name
        if not path.is_file():
            return None
        try:
            text = path.read_text()
        except OSError as exc:
            raise WeightsError(f"cannot read {path}: {exc}") from None
        where = str(path)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise WeightsError(f"{where} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else None


def ensure_weights(
    source: str,
    model: str,
    cache: Path,
    *,
    policy: WeightsPolicy | None = None,
    progress: Progress | None = None,
    timeout: float = 60.0,
) -> Path:
    """Return the verified cache directory holding ``source``'s weights, fetching them if needed.

    Raises :class:`WeightsError` for a missing source or manifest, a file outside the policy
    (pickle, model code) or a hash mismatch, naming the file and both hashes.
    """
    policy = policy or WeightsPolicy()
    remote = source.startswith(("http://", "https://", "s3://"))
    if remote:
        base = _http_base(source)
        manifest_url = f"{base}/{MANIFEST_NAME}"
        with _http_body(manifest_url, timeout) as body:
            text = b"".join(iter(body.read, b""))
        entries = parse_manifest(text.decode(errors="replace"), manifest_url)
    else:
        src = Path(source).expanduser().resolve()
        if not src.is_dir():
            raise WeightsError(
                f"weights source {src} is not a directory",
                hint="pass --source DIR or an http(s)/s3 URL holding the model and its SHA256SUMS",
            )
        entries = read_manifest(src)
    _check_policy(entries, policy, source)

    dest = cache.expanduser().resolve() / model / cache_digest(entries)
    if dest.is_dir():
        if not _stamp_valid(dest, entries):
            if progress:
                progress(f"weights: re-verifying {dest}")
            verify_dir(dest, entries)
            _stamp(dest, entries)
        _check_config(dest, policy)
        return dest

    if remote:

        def fetch(name: str, target: Path) -> str:
            with _http_body(f"{base}/{name}", timeout) as body:
                return _copy_hashing(body, target)

    else:

        def fetch(name: str, target: Path) -> str:
            path = src / name
            if not path.is_file():
                raise WeightsError(f"{path}: listed in the manifest but missing")
            with path.open("rb") as f:
                return _copy_hashing(f, target)

    _land(fetch, entries, dest, progress)
    _check_config(dest, policy)
    return dest
