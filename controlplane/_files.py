"""Small file-system helpers shared by modules that write files other programs read."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: Path, text: str, *, mode: int) -> None:
    """Write ``text`` to ``path`` so readers see the old file or the new one, never a partial one.

    The temporary file lives in the same directory (a rename is atomic only within one file system) and
    is fsynced before the rename. Raises ``OSError``; callers turn it into their own error.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
