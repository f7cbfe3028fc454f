"""All terminal output of ``llmctl``: rich is imported here and nowhere else (ruff banned-api)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import yaml
from rich.console import Console  # noqa: TID251 - the one place rich is allowed
from rich.progress import (  # noqa: TID251
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table  # noqa: TID251

__all__ = ["error", "out", "print_json", "print_yaml", "progress", "table", "warn"]


def _width() -> int | None:
    cols = os.environ.get("COLUMNS")
    if cols and cols.isdigit():
        return int(cols)
    # Piped output (scripts, logs, CI) has no terminal width: rich would assume 80 columns and fold
    # endpoints and GPU lists mid-word, so give it room; a terminal keeps its real width.
    return None if sys.stdout.isatty() else 160


def _stdout() -> Console:
    # A fresh Console per call: tests swap sys.stdout (CliRunner) and COLUMNS between invocations.
    return Console(file=sys.stdout, width=_width(), highlight=False, soft_wrap=True)


def _stderr() -> Console:
    return Console(file=sys.stderr, width=_width(), highlight=False, soft_wrap=True)


def out(text: str = "") -> None:
    """Plain text to stdout (no markup interpretation)."""
    _stdout().print(text, markup=False)


def warn(text: str) -> None:
    _stderr().print(f"warning: {text}", markup=False, style="yellow")


def error(text: str) -> None:
    """One-line error to stderr; the caller sets the exit code."""
    _stderr().print(f"error: {text}", markup=False, style="red")


def confirm(question: str, *, assume_yes: bool) -> bool:
    """Ask ``question`` (default no) when stdin is a terminal; scripts and ``--yes`` are not asked."""
    if assume_yes or not sys.stdin.isatty():
        return True
    from rich.prompt import Confirm  # noqa: TID251

    return Confirm.ask(question, console=_stderr(), default=False)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def print_yaml(data: Any) -> None:
    sys.stdout.write(yaml.safe_dump(data, sort_keys=False))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    t = Table(title=title, show_lines=False, header_style="bold")
    for h in headers:
        t.add_column(h, overflow="fold")
    for r in rows:
        t.add_row(*("" if c is None else str(c) for c in r))
    _stdout().print(t)


class _Progress:
    def __init__(self, progress: Progress | None) -> None:
        self._p = progress
        self._tasks: dict[str, Any] = {}

    def update(
        self,
        key: str,
        description: str,
        *,
        total: float | None = None,
        completed: float | None = None,
    ) -> None:
        """Show or update one line of progress; without a terminal, print it once per change."""
        if self._p is None:
            _stderr().print(f"… {description}", markup=False)
            return
        if key not in self._tasks:
            self._tasks[key] = self._p.add_task(description, total=total)
        self._p.update(self._tasks[key], description=description, total=total, completed=completed)


@contextmanager
def progress() -> Iterator[_Progress]:
    """Progress display on stderr for long work (deploys, downloads, benchmarks)."""
    if not sys.stderr.isatty():
        yield _Progress(None)
        return
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=_stderr(),
        transient=False,
    ) as p:
        yield _Progress(p)
