"""`llmctl teams create|list|set|delete`: teams of API keys and their limits."""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Annotated

import typer

from controlplane.cli import ui
from controlplane.cli.audit import audited
from controlplane.errors import NotFoundError, UserError

__all__ = ["register"]


class Output(StrEnum):
    TABLE = "table"
    JSON = "json"


def _limits(**kw: int | None) -> dict[str, str]:
    return {k: str(v) for k, v in kw.items() if v is not None}


def _fmt(v: int | None) -> str:
    return "-" if v is None else str(v)


def register(app: typer.Typer) -> None:  # noqa: PLR0915 - one nested function per command
    """Add ``llmctl teams …``."""
    teams = typer.Typer(help="Teams of API keys and their limits.", no_args_is_help=True)
    app.add_typer(teams, name="teams")

    @teams.command("create")
    def create(  # noqa: PLR0917 - Typer maps each CLI option to a parameter
        name: Annotated[str, typer.Argument(help="Team name (letters, digits, . _ -).")],
        model: Annotated[
            list[str] | None, typer.Option("--model", "-m", help="Allowed model (repeat); default: all.")
        ] = None,
        rpm: Annotated[int | None, typer.Option(min=1, help="Requests per minute.")] = None,
        tpm: Annotated[int | None, typer.Option(min=1, help="Tokens per minute.")] = None,
        daily_tokens: Annotated[int | None, typer.Option(min=1, help="Tokens per UTC day.")] = None,
        monthly_tokens: Annotated[int | None, typer.Option(min=1, help="Tokens per UTC month.")] = None,
        max_prompt_tokens: Annotated[int | None, typer.Option(min=1, help="Longest prompt accepted.")] = None,
    ) -> None:
        """Create a team."""
        from pydantic import ValidationError

        from controlplane.cli.keys import open_state
        from controlplane.errors import describe_validation_error
        from controlplane.state.base import TeamRecord

        try:
            record = TeamRecord(
                name=name,
                models=model or [],
                rpm=rpm,
                tpm=tpm,
                daily_tokens=daily_tokens,
                monthly_tokens=monthly_tokens,
                max_prompt_tokens=max_prompt_tokens,
                created_at=time.time(),
            )
        except ValidationError as exc:
            raise UserError(describe_validation_error(exc, what="team")) from None
        details = _limits(
            rpm=rpm,
            tpm=tpm,
            daily_tokens=daily_tokens,
            monthly_tokens=monthly_tokens,
            max_prompt_tokens=max_prompt_tokens,
        )
        with open_state() as store, audited(store, "teams.create", name, details):
            if store.get_team(name) is not None:
                raise UserError(f"a team named {name!r} exists", hint=f"llmctl teams set {name} …")
            store.put_team(record)
        ui.out(f"created team {name!r}")

    @teams.command("set")
    def set_(  # noqa: PLR0917
        name: Annotated[str, typer.Argument(help="Team name.")],
        model: Annotated[list[str] | None, typer.Option("--model", "-m", help="Allowed models.")] = None,
        rpm: Annotated[int | None, typer.Option(min=0, help="Requests per minute (0: none).")] = None,
        tpm: Annotated[int | None, typer.Option(min=0, help="Tokens per minute (0: none).")] = None,
        daily_tokens: Annotated[int | None, typer.Option(min=0, help="Tokens per day (0: none).")] = None,
        monthly_tokens: Annotated[int | None, typer.Option(min=0, help="Tokens per month (0: none).")] = None,
        max_prompt_tokens: Annotated[
            int | None, typer.Option(min=0, help="Longest prompt (0: none).")
        ] = None,
    ) -> None:
        """Change a team's limits; options not given keep their value, 0 removes a limit."""
        from controlplane.cli.keys import open_state

        given = {
            "rpm": rpm,
            "tpm": tpm,
            "daily_tokens": daily_tokens,
            "monthly_tokens": monthly_tokens,
            "max_prompt_tokens": max_prompt_tokens,
        }
        update: dict[str, object] = {k: (v or None) for k, v in given.items() if v is not None}
        if model is not None:
            update["models"] = model
        if not update:
            raise UserError("nothing to change", hint="give --rpm, --tpm, --daily-tokens, … or --model")
        with open_state() as store, audited(store, "teams.set", name, {k: str(v) for k, v in update.items()}):
            record = store.get_team(name)
            if record is None:
                raise NotFoundError(f"no team named {name!r}", hint="llmctl teams list")
            store.put_team(record.model_validate(record.model_dump() | update))
        ui.out(f"updated team {name!r}")

    @teams.command("list")
    def list_(
        output: Annotated[Output, typer.Option("--output", "-o", help="table or json.")] = Output.TABLE,
    ) -> None:
        """List teams, their limits and how many keys each has."""
        from controlplane.cli.keys import open_state

        with open_state() as store:
            records = store.list_teams()
            counts: dict[str, int] = {}
            for k in store.list_api_keys():
                if k.team and not k.revoked:
                    counts[k.team] = counts.get(k.team, 0) + 1
        if output is Output.JSON:
            ui.print_json([r.model_dump() | {"keys": counts.get(r.name, 0)} for r in records])
            return
        rows = [
            [
                r.name,
                ",".join(r.models) or "*",
                *(_fmt(v) for v in (r.rpm, r.tpm, r.daily_tokens, r.monthly_tokens, r.max_prompt_tokens)),
                str(counts.get(r.name, 0)),
            ]
            for r in records
        ]
        ui.table(["name", "models", "rpm", "tpm", "daily", "monthly", "max prompt", "keys"], rows)

    @teams.command("delete")
    def delete(
        name: Annotated[str, typer.Argument(help="Team name.")],
        yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    ) -> None:
        """Delete a team that no active key belongs to."""
        from controlplane.cli.keys import open_state

        with open_state() as store:
            if store.get_team(name) is None:
                raise NotFoundError(f"no team named {name!r}", hint="llmctl teams list")
            members = [k.name for k in store.list_api_keys() if k.team == name and not k.revoked]
            if members:
                raise UserError(
                    f"team {name!r} still has {len(members)} active key(s): {', '.join(members[:5])}",
                    hint="revoke them first (llmctl keys revoke NAME)",
                )
            if not ui.confirm(f"delete team {name!r}?", assume_yes=yes):
                ui.out("nothing changed")
                raise typer.Exit(1)
            with audited(store, "teams.delete", name):
                store.delete_team(name)
        ui.out(f"deleted team {name!r}")
