"""`llmctl usage`: what each key, team and model used, per hour, from the gateways' usage record."""

from __future__ import annotations

import time
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controlplane.cli import ui
from controlplane.cli.audit import parse_since

if TYPE_CHECKING:
    from controlplane.state.base import UsageRecord

__all__ = ["register"]

_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "errors", "rejected", "cost")


class Output(StrEnum):
    TABLE = "table"
    JSON = "json"
    CSV = "csv"


class By(StrEnum):
    HOUR = "hour"
    KEY = "key"
    TEAM = "team"
    MODEL = "model"


def _group(rows: list[UsageRecord], by: By) -> list[dict[str, Any]]:
    """One dict per row (``hour``) or per key, team or model, the counts summed over the rest."""
    if by is By.HOUR:
        return [r.model_dump() for r in rows]
    sums: dict[str, dict[str, Any]] = {}
    for r in rows:
        name = str(getattr(r, by.value))
        acc = sums.setdefault(name, {by.value: name} | dict.fromkeys(_COUNTS, 0))
        for c in _COUNTS:
            acc[c] += getattr(r, c)
    return [sums[k] for k in sorted(sums)]


def register(app: typer.Typer) -> None:
    """Add ``llmctl usage``."""

    @app.command("usage")
    def usage(  # noqa: PLR0917 - Typer maps each CLI option to a parameter
        team: Annotated[str | None, typer.Option(help='Only this team ("": keys without a team).')] = None,
        key: Annotated[str | None, typer.Option(help="Only this key (its name).")] = None,
        model: Annotated[str | None, typer.Option(help="Only this model.")] = None,
        since: Annotated[
            str, typer.Option(help="From this long ago (24h, 7d) or an ISO time (UTC).")
        ] = "24h",
        until: Annotated[str | None, typer.Option(help="Until this long ago or ISO time (UTC).")] = None,
        by: Annotated[
            By, typer.Option(help="hour (a row per hour, key, team, model), key, team or model.")
        ] = By.HOUR,
        output: Annotated[Output, typer.Option("--output", "-o", help="table, json or csv.")] = Output.TABLE,
    ) -> None:
        """Requests, tokens, errors, rejections and cost per key, team, model and hour (UTC)."""
        from controlplane.cli.keys import open_state

        now = time.time()
        start = parse_since(since, now)
        end = parse_since(until, now) if until else None
        with open_state() as store:
            rows = [
                r
                for r in store.list_usage(start, end)
                if (team is None or r.team == team)
                and (key is None or r.key == key)
                and (model is None or r.model == model)
            ]
        data = _group(rows, by)
        for d in data:
            d["cost"] = round(float(d["cost"]), 6)
        if output is Output.JSON:
            ui.print_json(data)
            return
        columns = ["hour", "key", "team", "model"] if by is By.HOUR else [by.value]
        if by is By.HOUR:
            for d in data:
                d["hour"] = time.strftime("%Y-%m-%dT%H:00Z", time.gmtime(int(d["hour"])))
        headers = [*columns, *_COUNTS]
        if output is Output.CSV:
            import csv
            import io

            buf = io.StringIO()
            writer = csv.writer(buf, lineterminator="\n")
            writer.writerow(headers)
            writer.writerows([d[h] for h in headers] for d in data)
            ui.out(buf.getvalue().rstrip("\n"))
            return
        ui.table(headers, [[str(d[h]) for h in headers] for d in data])
