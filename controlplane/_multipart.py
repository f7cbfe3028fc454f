"""The named text fields of a ``multipart/form-data`` body, found without copying its file parts."""

from __future__ import annotations

import contextlib
import re

__all__ = ["boundary", "form_fields"]

_BOUNDARY = re.compile(rb'boundary="?([^";,\s]{1,200})"?', re.IGNORECASE)
_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)


def boundary(content_type: bytes) -> bytes | None:
    """The boundary of a ``multipart/form-data`` content type; None for any other type."""
    if not content_type[:19].lower().startswith(b"multipart/form-data"):
        return None
    m = _BOUNDARY.search(content_type)
    return m.group(1) if m else None


def form_fields(body: bytes, sep: bytes, names: frozenset[str], max_value: int = 4096) -> dict[str, str]:
    """The values of the parts named in ``names`` (text of at most ``max_value`` bytes each).

    Only part headers are read; the other parts (the audio file) are skipped by offset, never copied.
    A part without a name, a field over ``max_value`` or bytes that are not UTF-8 are left out.
    """
    delim = b"--" + sep
    out: dict[str, str] = {}
    pos = body.find(delim)
    while pos != -1:
        start = pos + len(delim)
        if body[start : start + 2] == b"--":  # the closing delimiter
            break
        nxt = body.find(b"\r\n" + delim, start)
        if nxt == -1:
            break
        head_end = body.find(b"\r\n\r\n", start, nxt)
        if head_end != -1:
            m = _NAME.search(body, start, head_end)
            name = m.group(1).decode("latin-1") if m else ""
            value = body[head_end + 4 : nxt] if name in names and nxt - head_end - 4 <= max_value else None
            if value is not None and name not in out:
                with contextlib.suppress(UnicodeDecodeError):  # not text: leave the field out
                    out[name] = value.decode("utf-8")
        pos = nxt + 2
    return out
