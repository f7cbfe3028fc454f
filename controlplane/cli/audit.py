"""The audit trail of administrative commands: :func:`audited` around each, ``llmctl audit`` to read it."""

from __future__ import annotations

import getpass
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from controlplane.cli import ui
from controlplane.errors import SarvError, UserError

if TYPE_CHECKING:
    from controlplane.state.base import StateStore

__all__ = ["actor", "audited", "parse_duration", "parse_since", "register"]

logger = logging.getLogger(__name__)

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def actor() -> str:
    """``user@host`` of the person running ``llmctl``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


@contextmanager
def audited(
    store: StateStore, action: str, target: str = "", details: dict[str, str] | None = None
) -> Iterator[None]:
    """Record ``action`` on ``target`` in the audit trail when the block ends: ``ok`` or the error line.

    A failure to write the trail is a warning, never a replacement for the command's own outcome.
    """
    from controlplane.state.base import AuditEntry

    outcome = "ok"
    try:
        yield
    except typer.Exit as exc:
        outcome = "ok" if exc.exit_code == 0 else f"exit {exc.exit_code}"
        raise
    except SarvError as exc:
        outcome = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise
    except BaseException as exc:
        outcome = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise
    finally:
        entry = AuditEntry(
            at=time.time(),
            actor=actor(),
            action=action,
            target=target,
            details=details or {},
            outcome=outcome,
        )
        try:
            store.append_audit(entry)
        except SarvError as exc:
            ui.warn(f"the audit trail could not be written: {exc}")


def parse_duration(text: str, what: str = "duration") -> float:
    """``120``, ``120s``, ``2m``, ``1h`` → seconds."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if m is None:
        raise UserError(f"{what} {text!r} is not a duration", hint="give seconds or e.g. 120s, 5m, 1h")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def parse_since(text: str, now: float) -> float:
    """``2h``/``7d`` ago, or an ISO date/time (UTC) → a timestamp."""
    import re
    from datetime import UTC, datetime

    m = re.fullmatch(r"\s*(\d+)\s*([smhdw])\s*", text)
    if m is not None:
        return now - int(m.group(1)) * _UNITS[m.group(2)]
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise UserError(
            f"time {text!r} is neither a duration (30m, 2h, 7d) nor an ISO date (2026-12-01T10:00)"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


class Output(StrEnum):
    TABLE = "table"
    JSON = "json"


def register(app: typer.Typer) -> None:
    """Add ``llmctl audit``."""

    @app.command("audit")
    def audit(
        since: Annotated[
            str | None, typer.Option(help="From this long ago (24h, 7d) or an ISO time (UTC).")
        ] = None,
        output: Annotated[Output, typer.Option("--output", "-o", help="table or json.")] = Output.TABLE,
    ) -> None:
        """Show the audit trail of administrative actions (oldest first)."""
        from controlplane.cli.keys import open_state

        start = parse_since(since, time.time()) if since else 0.0
        with open_state() as store:
            entries = store.list_audit(start)
        if output is Output.JSON:
            ui.print_json([e.model_dump() for e in entries])
            return
        rows = [
            [
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.at)),
                e.actor,
                e.action,
                e.target,
                " ".join(f"{k}={v}" for k, v in sorted(e.details.items())),
                e.outcome,
            ]
            for e in entries
        ]
        ui.table(["time (UTC)", "who", "action", "target", "details", "outcome"], rows)
