"""Option types shared by ``llmctl`` commands."""

from __future__ import annotations

from pathlib import Path

__all__ = ["optional_path"]


def optional_path(value: str) -> Path | None:
    """A path option where an empty value means "not given", like an empty ``SARV_*`` variable.

    ``Path("")`` is the current directory, and an inventory there makes ansible-core run every
    executable file in it as an inventory script; ``-i ""`` must fall back to the default instead.
    """
    return Path(value) if value else None
