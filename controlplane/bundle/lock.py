"""The lock files of Sarv's runtime Python set (``requirements/lock-py3XX.txt``, written by ``scripts/lock``).

One file per Python version the fleet runs, with every transitive requirement pinned (``name==version``)
and the sha256 of each allowed distribution file, in pip's ``--require-hashes`` format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from controlplane.errors import ConfigError

__all__ = ["LOCK_DIR", "Pin", "lock_path", "normalize_name", "read_lock"]

LOCK_DIR = Path(__file__).resolve().parents[2] / "requirements"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class Pin:
    """One locked requirement: its exact version and the hashes of the files pip may install."""

    name: str
    version: str
    hashes: frozenset[str]


def normalize_name(name: str) -> str:
    """PEP 503 normalisation: ``Typing_Extensions`` and ``typing-extensions`` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_path(python: str, directory: Path = LOCK_DIR) -> Path:
    """The lock file for ``python`` (``3.11`` → ``lock-py311.txt``); a clear error when there is none."""
    path = directory / f"lock-py{python.replace('.', '')}.txt"
    if not path.is_file():
        have = sorted(p.name for p in directory.glob("lock-py*.txt")) if directory.is_dir() else []
        raise ConfigError(
            f"no lock file for Python {python} ({path})",
            hint=f"available: {', '.join(have) or 'none'}; add the version to scripts/lock and run it",
        )
    return path


def read_lock(path: Path) -> dict[str, Pin]:
    """The pins of a lock file by normalised name; a line that pins nothing exactly is refused."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read lock file {path}: {exc}") from None
    pins: dict[str, Pin] = {}
    # Continuation lines (``\``) belong to the requirement above them.
    for lineno, logical in enumerate(text.replace("\\\n", " ").splitlines(), 1):
        line = logical.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        m = _PIN.match(line)
        if m is None:
            raise ConfigError(f"{path} line {lineno}: {line[:60]!r} is not pinned with ==")
        name = normalize_name(m.group(1))
        pins[name] = Pin(name=name, version=m.group(3), hashes=frozenset(_HASH.findall(line)))
    return pins
