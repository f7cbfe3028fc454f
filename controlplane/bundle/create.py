"""``llmctl bundle create``: gather every part a site needs into a signed bundle file.

Parts are gathered into ``<FILE>.work/<part>/``; each finished part records its files and hashes in
``<FILE>.work/.done/<part>.json``, so a rerun skips every part whose files are still there and still
hash the same. The tar is written last, after the size of each part has been printed.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from controlplane.bundle.lock import lock_path
from controlplane.bundle.manifest import (
    MANIFEST,
    SIGNATURE,
    BaseRef,
    FileEntry,
    Manifest,
    manifest_digest,
    open_bundle,
    sign_manifest,
)
from controlplane.errors import BundleError, ConfigError
from controlplane.weights import MANIFEST_NAME, ensure_weights, sha256_file

__all__ = [
    "PARTS",
    "BundleRequest",
    "build_apt_repository",
    "create_bundle",
    "human_size",
    "wheel_download_argv",
]

PARTS = ("wheels", "debs", "images", "models", "dashboards", "terraform")
Progress = Callable[[str], None]
_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class BundleRequest:
    """What to put in a bundle; built by the CLI from the inventory and its options."""

    output: Path
    sign_key: Path
    python: str = "3.11"
    release: str = "bookworm"
    lock: Path | None = None
    find_links: list[Path] = field(default_factory=list)
    index_url: str | None = None
    sarv_wheel: Path | None = None
    """A built Sarv wheel; unset: built from this checkout (``pip wheel --no-deps``)."""
    packages: list[str] = field(default_factory=list)
    deb_caches: list[Path] = field(default_factory=list)
    """Directories of ``.deb`` files reused when their hash matches the index; new downloads are added to
    the last one."""
    gpg_key: str | None = None
    """The OpenPGP key (id or fingerprint in ``$GNUPGHOME``) that signs the apt repository's index."""
    images: list[str] = field(default_factory=list)
    no_images: bool = False
    models: dict[str, str] = field(default_factory=dict)
    """Model store path (``NAME/VARIANT``) → weights source (a directory or URL with a SHA256SUMS)."""
    generated: dict[str, Callable[[Path], object]] = field(default_factory=dict)
    """Model store path → a generator writing the weights (the tiny test model)."""
    terraform_mirror: Path | None = None
    since: Path | None = None


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


def _run(argv: Sequence[str], what: str, *, cwd: Path | None = None, timeout: float = 3600) -> str:
    try:
        proc = subprocess.run(
            list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise ConfigError(f"cannot {what}: {argv[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise BundleError(f"cannot {what}: `{' '.join(argv[:3])} …` did not finish in {timeout:g}s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise BundleError(f"cannot {what}: {' / '.join(tail) or f'exit {proc.returncode}'}")
    return proc.stdout


# --- one part each


def wheel_download_argv(
    python: str, lock: Path, dest: Path, find_links: Sequence[Path] = (), index_url: str | None = None
) -> list[str]:
    """``pip download`` of every wheel ``lock`` pins (hashes required) for CPython ``python`` on x86_64
    manylinux into ``dest``: from ``find_links`` only (``--no-index``) when given without ``index_url``."""
    tag = python.replace(".", "")
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    argv += ["--only-binary=:all:", "--no-deps", "--require-hashes", "-r", str(lock), "-d", str(dest)]
    argv += ["--python-version", python, "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3"]
    argv += ["--abi", "none"]
    for platform in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"):
        argv += ["--platform", platform]
    for links in find_links:
        argv += ["--find-links", str(links)]
    if index_url:
        argv += ["--index-url", index_url]
    elif find_links:
        argv.append("--no-index")
    return argv


def _wheels(req: BundleRequest, dest: Path, say: Progress) -> dict[str, str]:
    lock = req.lock or lock_path(req.python)
    argv = wheel_download_argv(req.python, lock, dest, req.find_links, req.index_url)
    say(f"wheels: pip download -r {lock} for CPython {req.python} (x86_64 manylinux)")
    _run(argv, f"download the wheels of {lock}")
    if req.sarv_wheel is not None:
        if not req.sarv_wheel.is_file():
            raise ConfigError(f"Sarv wheel {req.sarv_wheel} does not exist")
        shutil.copy2(req.sarv_wheel, dest / req.sarv_wheel.name)
    else:
        say("wheels: building the Sarv wheel from this checkout")
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(dest),
                str(_ROOT),
            ],
            "build the Sarv wheel (pip wheel --no-deps .)",
        )
    return {"python": req.python, "lock": lock.name}


_PRINT_URI = re.compile(r"^'(?P<uri>[^']+)' (?P<file>\S+) (?P<size>\d+) (?P<hash>\S+)")


def _deb_closure(packages: list[str]) -> list[str]:
    """The packages and everything a fresh install of them pulls in (no recommends), minus the base system
    every host has.

    apt's own resolver decides, simulating the install on a system with nothing installed (an empty
    dpkg status file): of an ``a | b`` dependency it takes the alternative apt would, not all of them
    (``apt-cache depends --recurse`` follows every alternative: gnupg's pinentry brought GTK and Qt).
    A host that already has another alternative needs nothing from the group."""
    with tempfile.NamedTemporaryFile(prefix="sarv-empty-status-") as status:
        out = _run(
            [
                "apt-get",
                "--simulate",
                "--quiet",
                "-o",
                f"Dir::State::status={status.name}",
                "-o",
                "APT::Install-Recommends=false",
                "-o",
                "APT::Install-Suggests=false",
                "install",
                *packages,
            ],
            "resolve the packages' dependencies (apt-get --simulate install)",
        )
    names = sorted({line.split()[1] for line in out.splitlines() if line.startswith("Inst ")})
    shown = _run(["apt-cache", "show", "--no-all-versions", *names], "read the packages' priorities")
    base: set[str] = set()
    for stanza in shown.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" ")
        )
        if fields.get("Priority") == "required" or fields.get("Essential") == "yes":
            base.add(fields.get("Package", ""))
    return [n for n in names if n not in base or n in packages]


@dataclass(frozen=True)
class _Deb:
    name: str
    file: str
    size: int
    sha256: str


def _deb_plan(packages: list[str]) -> list[_Deb]:
    names = _deb_closure(packages)
    out = _run(["apt-get", "download", "--print-uris", *names], "list the packages to download")
    debs = []
    for line in out.splitlines():
        m = _PRINT_URI.match(line)
        if m is not None:
            name = m.group("file").split("_", 1)[0]
            debs.append(
                _Deb(name, m.group("file"), int(m.group("size")), m.group("hash").removeprefix("SHA256:"))
            )
    return debs


def _from_cache(deb: _Deb, caches: Sequence[Path], pool: Path) -> bool:
    """Copy ``deb`` from a local cache (apt's own archive cache included) when its hash is the index's."""
    for cache in caches:
        candidate = cache / deb.file
        if (
            candidate.is_file()
            and candidate.stat().st_size == deb.size
            and sha256_file(candidate) == deb.sha256
        ):
            shutil.copy2(candidate, pool / deb.file)
            return True
    return False


def _release_file(dists: Path, suite: str, arch: str) -> str:
    lines = [
        "Origin: sarv-bundle",
        "Label: sarv-bundle",
        f"Suite: {suite}",
        f"Codename: {suite}",
        f"Date: {datetime.now(UTC).strftime('%a, %d %b %Y %H:%M:%S UTC')}",
        f"Architectures: {arch}",
        "Components: main",
        "SHA256:",
    ]
    for path in sorted(p for p in dists.rglob("Packages*") if p.is_file()):
        rel = path.relative_to(dists).as_posix()
        lines.append(f" {sha256_file(path)} {path.stat().st_size} {rel}")
    return "\n".join(lines) + "\n"


def _debs(req: BundleRequest, dest: Path, say: Progress) -> dict[str, str]:
    key = req.gpg_key or ""  # create_bundle refuses packages without a key before anything runs
    return build_apt_repository(
        req.packages, dest, key, release=req.release, deb_caches=req.deb_caches, say=say
    )


def build_apt_repository(
    packages: list[str],
    dest: Path,
    gpg_key: str,
    *,
    release: str = "bookworm",
    deb_caches: Sequence[Path] = (),
    say: Progress = print,
) -> dict[str, str]:
    """A signed apt repository in ``dest`` of ``packages`` and their dependencies beyond the base system,
    from this machine's apt sources (``deb_caches`` first): ``pool/``, ``dists/<release>/`` and an empty
    ``dists/<release>-updates/``, indexes signed by ``gpg_key`` (in ``$GNUPGHOME``), its public key as
    ``sarv-bundle.asc``. Returns what the manifest records of it."""
    debs = _deb_plan(packages)
    names = [d.name for d in debs]
    pool = dest / "pool"
    pool.mkdir(parents=True, exist_ok=True)
    fetch = [d for d in debs if not _from_cache(d, deb_caches, pool)]
    say(
        f"debs: {len(debs) - len(fetch)} of {len(debs)} packages from local caches, "
        f"apt-get download {len(fetch)}"
    )
    if fetch:
        _run(
            ["apt-get", "download", *[d.name for d in fetch]],
            "download the packages (apt-get download)",
            cwd=pool,
        )
    for d in debs:
        if sha256_file(pool / d.file) != d.sha256:
            raise BundleError(f"debs: {d.file} does not match the sha256 of apt's index ({d.sha256})")
    if deb_caches:
        keep = deb_caches[-1]
        keep.mkdir(parents=True, exist_ok=True)
        for d in fetch:
            shutil.copy2(pool / d.file, keep / d.file)
    arch = _run(["dpkg", "--print-architecture"], "read the architecture").strip()
    index = _run(["dpkg-scanpackages", "--multiversion", "pool", "/dev/null"], "index the packages", cwd=dest)
    # The common role's sources.list names <release> and <release>-updates: both exist, -updates empty.
    for suite, text in ((release, index), (f"{release}-updates", "")):
        dists = dest / "dists" / suite
        binary = dists / "main" / f"binary-{arch}"
        binary.mkdir(parents=True, exist_ok=True)
        (binary / "Packages").write_text(text)
        (binary / "Packages.gz").write_bytes(gzip.compress(text.encode(), mtime=0))
        (dists / "Release").write_text(_release_file(dists, suite, arch))
        for out, mode in (("InRelease", "--clearsign"), ("Release.gpg", "--detach-sign")):
            (dists / out).unlink(missing_ok=True)
            _run(
                [
                    "gpg",
                    "--batch",
                    "--yes",
                    "--armor",
                    "--local-user",
                    gpg_key,
                    mode,
                    "-o",
                    str(dists / out),
                    str(dists / "Release"),
                ],
                "sign the repository index (gpg)",
            )
    _run(
        ["gpg", "--batch", "--yes", "--armor", "-o", str(dest / "sarv-bundle.asc"), "--export", gpg_key],
        "export the repository key",
    )
    fpr = _run(["gpg", "--batch", "--with-colons", "--fingerprint", gpg_key], "read the key fingerprint")
    fingerprint = next((line.split(":")[9] for line in fpr.splitlines() if line.startswith("fpr")), "")
    return {"release": release, "arch": arch, "packages": ",".join(names), "key_fingerprint": fingerprint}


def _docker_inspect(ref: str, fmt: str) -> str | None:
    try:
        proc = subprocess.run(
            ["docker", "image", "inspect", "-f", fmt, ref],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except FileNotFoundError:
        raise ConfigError(
            "cannot save images: docker is not installed", hint="apt-get install docker.io"
        ) from None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _check_images(refs: list[str]) -> int:
    missing = [r for r in refs if _docker_inspect(r, "{{.Id}}") is None]
    if missing:
        raise BundleError(
            f"image(s) not in this machine's Docker: {', '.join(missing)}",
            hint="`docker pull` each on a connected machine (or `docker load` it), then rerun; "
            "--no-images leaves images out of the bundle on purpose",
        )
    return sum(int(_docker_inspect(r, "{{.Size}}") or 0) for r in refs)


def image_file(ref: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", ref) + ".tar"


def _images(req: BundleRequest, dest: Path, say: Progress) -> dict[str, str]:
    if req.no_images:
        return {"left_out": "--no-images: the nodes need the images from elsewhere"}
    info: dict[str, str] = {}
    for i, ref in enumerate(req.images, 1):
        say(f"images: docker save {ref} ({i}/{len(req.images)})")
        _run(["docker", "save", "-o", str(dest / image_file(ref)), ref], f"save image {ref}")
        digests = _docker_inspect(ref, '{{join .RepoDigests ","}}') or ""
        info[ref] = f"{_docker_inspect(ref, '{{.Id}}')} {digests}".strip()
    return info


def _models(req: BundleRequest, dest: Path, say: Progress) -> dict[str, str]:
    info: dict[str, str] = {}
    for store_path, generate in req.generated.items():
        say(f"models: generating {store_path}")
        generate(dest / store_path)
        info[store_path] = "generated"
    cache = dest.parent / ".weights-cache"
    for store_path, source in req.models.items():
        say(f"models: fetching and verifying {store_path} from {source}")
        landed = ensure_weights(source, store_path.replace("/", "-"), cache, progress=say)
        target = dest / store_path
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(landed, target, ignore=shutil.ignore_patterns(".*"))
        info[store_path] = source
    for store_path in info:
        if not (dest / store_path / MANIFEST_NAME).is_file():
            raise BundleError(f"models: {store_path} has no {MANIFEST_NAME}")
    return info


def _dashboards(req: BundleRequest, dest: Path, say: Progress) -> dict[str, str]:
    src = _ROOT / "dashboards"
    for path in sorted(src.rglob("*")):
        if path.is_file() and path.suffix in {".json", ".yml", ".yaml"}:
            target = dest / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    return {"source": "dashboards/ (Grafana JSON and Prometheus rules)"}


def _terraform(req: BundleRequest, dest: Path, say: Progress) -> dict[str, str]:
    if req.terraform_mirror is None:
        return {"left_out": "no --terraform-mirror given (a `terraform providers mirror` directory)"}
    if not req.terraform_mirror.is_dir():
        raise ConfigError(f"terraform provider mirror {req.terraform_mirror} is not a directory")
    shutil.copytree(req.terraform_mirror, dest, dirs_exist_ok=True)
    return {"source": str(req.terraform_mirror)}


_GATHER: dict[str, Callable[[BundleRequest, Path, Progress], dict[str, str]]] = {
    "wheels": _wheels,
    "debs": _debs,
    "images": _images,
    "models": _models,
    "dashboards": _dashboards,
    "terraform": _terraform,
}


# --- resumable staging


def _scan(root: Path, part: str) -> list[FileEntry]:
    base = root / part
    return [
        FileEntry(
            path=p.relative_to(root).as_posix(), part=part, sha256=sha256_file(p), size=p.stat().st_size
        )
        for p in sorted(base.rglob("*"))
        if p.is_file()
    ]


def _inputs(req: BundleRequest, part: str) -> str:
    """What a part is gathered from: a part recorded from other inputs is gathered again."""
    lock = req.lock or (lock_path(req.python) if part == "wheels" else None)
    by_part: dict[str, object] = {
        "wheels": [req.python, sha256_file(lock) if lock else "", [str(p) for p in req.find_links],
                   req.index_url, str(req.sarv_wheel)],
        "debs": [req.release, sorted(req.packages), req.gpg_key],
        "images": [sorted(req.images), req.no_images],
        "models": [sorted(req.models.items()), sorted(req.generated)],
        "terraform": [str(req.terraform_mirror)],
    }  # fmt: skip
    return hashlib.sha256(json.dumps(by_part.get(part, [])).encode()).hexdigest()


def _done_part(work: Path, part: str, inputs: str) -> tuple[list[FileEntry], dict[str, str]] | None:
    """The recorded files of a finished part when its inputs are the same and every file is still there
    with its hash."""
    stamp = work / ".done" / f"{part}.json"
    try:
        data = json.loads(stamp.read_text())
        if data.get("inputs") != inputs:
            return None
        files = [FileEntry.model_validate(f) for f in data["files"]]
        info = {str(k): str(v) for k, v in data["info"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    current = {f.path: f for f in _scan(work, part)}
    if current != {f.path: f for f in files}:
        return None
    return files, info


def _estimate(req: BundleRequest) -> dict[str, str]:
    """What each large part will take, known before anything is downloaded or saved."""
    est: dict[str, str] = {}
    if req.packages:
        debs = _deb_plan(req.packages)
        est["debs"] = f"{len(debs)} packages, {human_size(sum(d.size for d in debs))}"
    if req.images and not req.no_images:
        est["images"] = f"{len(req.images)} images, {human_size(_check_images(req.images))} unpacked"
    return est


def create_bundle(req: BundleRequest, say: Progress) -> Manifest:
    """Gather, hash, sign and write the bundle; parts finished by an earlier run are reused."""
    if req.packages and not req.gpg_key:
        raise ConfigError(
            "the package repository needs a signing key",
            hint="give --gpg-key KEYID (a key in $GNUPGHOME; gpg --quick-gen-key makes one)",
        )
    if not req.sign_key.is_file():
        raise ConfigError(
            f"signing key {req.sign_key} does not exist",
            hint="give --sign-key a private SSH key (ssh-keygen -t ed25519 -f KEY makes one)",
        )
    work = req.output.with_name(req.output.name + ".work")
    (work / ".done").mkdir(parents=True, exist_ok=True)
    for part, estimate in _estimate(req).items():
        say(f"plan: {part}: {estimate}")
    files: list[FileEntry] = []
    parts: dict[str, dict[str, str]] = {}
    for part in PARTS:
        if part == "debs" and not req.packages:
            parts[part] = {"left_out": "no packages requested"}
            continue
        inputs = _inputs(req, part)
        done = _done_part(work, part, inputs)
        if done is not None:
            say(f"{part}: already gathered and verified, skipped")
            part_files, info = done
        else:
            shutil.rmtree(work / part, ignore_errors=True)
            (work / part).mkdir(parents=True)
            info = _GATHER[part](req, work / part, say)
            part_files = _scan(work, part)
            stamp = {"inputs": inputs, "files": [f.model_dump() for f in part_files], "info": info}
            (work / ".done" / f"{part}.json").write_text(json.dumps(stamp))
        files += part_files
        parts[part] = info
    manifest = Manifest(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        python=req.python,
        release=req.release,
        parts=parts,
        files=files,
    )
    if req.since is not None:
        manifest = _incremental(manifest, req.since)
    for part in PARTS:
        entries = manifest.by_part(part)
        packed = [f for f in entries if not f.in_base]
        say(
            f"size: {part}: {len(packed)} files, {human_size(sum(f.size for f in packed))}"
            + (
                f" ({len(entries) - len(packed)} unchanged, in the base bundle)"
                if len(packed) < len(entries)
                else ""
            )
        )
    _write_tar(req, work, manifest, say)
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def _incremental(manifest: Manifest, since: Path) -> Manifest:
    base, raw, _ = open_bundle(since)
    carried = {(f.path, f.sha256) for f in base.files if not f.in_base}
    files = [f.model_copy(update={"in_base": (f.path, f.sha256) in carried}) for f in manifest.files]
    return manifest.model_copy(
        update={"files": files, "base": BaseRef(name=since.name, manifest_sha256=manifest_digest(raw))}
    )


def _write_tar(req: BundleRequest, work: Path, manifest: Manifest, say: Progress) -> None:
    data = manifest.dumps()
    signature = sign_manifest(data, req.sign_key)
    tmp = req.output.with_name(f".{req.output.name}.tmp")
    packed = [f for f in manifest.files if not f.in_base]
    total = sum(f.size for f in packed)
    written = 0
    with tarfile.open(tmp, "w:", format=tarfile.PAX_FORMAT) as tar:
        for name, blob in ((MANIFEST, data), (SIGNATURE, signature)):
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(blob))
        for i, entry in enumerate(packed, 1):
            tar.add(work / entry.path, arcname=entry.path, recursive=False)
            written += entry.size
            if i == len(packed) or i % 50 == 0:
                say(f"write: {i}/{len(packed)} files, {human_size(written)} of {human_size(total)}")
    os.replace(tmp, req.output)
    say(f"wrote {req.output} (manifest sha256 {hashlib.sha256(data).hexdigest()[:16]})")
