"""`llmctl keys create|list|revoke`: API keys of the gateway (only a sha256 of each key is stored)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer

from controlplane.cli import ui
from controlplane.errors import NotFoundError, UserError

if TYPE_CHECKING:
    from controlplane.state.base import ApiKeyRecord, StateStore

__all__ = ["open_state", "parse_duration", "register"]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class Output(StrEnum):
    TEXT = "text"
    JSON = "json"


class ListOutput(StrEnum):
    TABLE = "table"
    JSON = "json"


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``30d``, ``2w`` → seconds."""
    m = re.fullmatch(r"\s*(\d+)\s*([smhdw])\s*", text)
    if m is None:
        raise UserError(f"--expires-in {text!r} must be a number and a unit s|m|h|d|w (e.g. 30d)")
    seconds = float(int(m.group(1)) * _UNITS[m.group(2)])
    if seconds <= 0:
        # A key that is expired when it is made would be shown once and then refused: say so instead.
        raise UserError(
            f"--expires-in {text!r} is over before the key exists", hint="give a lifetime, e.g. 30d"
        )
    return seconds


@contextmanager
def open_state() -> Iterator[StateStore]:
    from controlplane.settings import load_settings
    from controlplane.state import open_store

    settings = load_settings()
    store: StateStore = open_store(settings.resolved_state_url, settings)
    try:
        yield store
    finally:
        store.close()


def _fmt_limit(v: int | None) -> str:
    return "-" if v is None else str(v)


def _row(r: ApiKeyRecord, now: float) -> list[str]:
    if r.revoked:
        state = "revoked"
    elif r.expires_at is not None and r.expires_at <= now:
        state = "expired"
    else:
        state = "active"
    expires = "-" if r.expires_at is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(r.expires_at))
    limits = [_fmt_limit(v) for v in (r.rpm, r.tpm, r.daily_tokens)]
    return [r.name, r.prefix + "…", ",".join(r.models) or "*", *limits, expires, state]


def register(app: typer.Typer) -> None:  # noqa: PLR0915 - one nested function per command
    """Add ``llmctl keys …`` to ``app``."""
    keys = typer.Typer(
        help="API keys of the gateway: create (shown once), list, revoke.", no_args_is_help=True
    )
    app.add_typer(keys, name="keys")

    @keys.command("create")
    def create(  # noqa: PLR0917 - Typer maps each CLI option to a parameter
        name: Annotated[str, typer.Argument(help="Unique name of the key (shown in metrics and logs).")],
        model: Annotated[
            list[str] | None, typer.Option("--model", "-m", help="Allowed model (repeat); default: all.")
        ] = None,
        rpm: Annotated[int | None, typer.Option(min=1, help="Requests per minute.")] = None,
        tpm: Annotated[
            int | None, typer.Option(min=1, help="Tokens per minute (prompt + completion).")
        ] = None,
        daily_tokens: Annotated[int | None, typer.Option(min=1, help="Tokens per UTC day.")] = None,
        max_prompt_tokens: Annotated[int | None, typer.Option(min=1, help="Longest prompt accepted.")] = None,
        expires_in: Annotated[
            str | None, typer.Option(help="Lifetime, e.g. 30d, 12h; default: none.")
        ] = None,
        team: Annotated[
            str | None, typer.Option(help="Team the key belongs to (llmctl teams create); default: none.")
        ] = None,
        output: Annotated[Output, typer.Option("--output", "-o", help="text or json.")] = Output.TEXT,
    ) -> None:
        """Create a key. The key is printed once and cannot be shown again."""
        from pydantic import ValidationError

        from controlplane.errors import describe_validation_error
        from controlplane.gateway.auth import hash_key, new_key
        from controlplane.state.base import ApiKeyRecord

        now = time.time()
        expires_at = now + parse_duration(expires_in) if expires_in else None
        secret = new_key()
        try:
            record = ApiKeyRecord(
                name=name,
                key_hash=hash_key(secret),
                prefix=secret[:12],
                models=model or [],
                rpm=rpm,
                tpm=tpm,
                daily_tokens=daily_tokens,
                max_prompt_tokens=max_prompt_tokens,
                expires_at=expires_at,
                created_at=now,
                team=team,
            )
        except ValidationError as exc:
            raise UserError(describe_validation_error(exc, what="key")) from None
        from controlplane.cli.audit import audited

        details = {"team": team} if team else {}
        with open_state() as store, audited(store, "keys.create", name, details):
            if team is not None and store.get_team(team) is None:
                raise NotFoundError(f"no team named {team!r}", hint=f"llmctl teams create {team}")
            old = store.get_api_key_by_name(name)
            if old is not None and not old.revoked:
                raise UserError(f"a key named {name!r} exists", hint=f"llmctl keys revoke {name} first")
            store.put_api_key(record)
        if output is Output.JSON:
            ui.print_json({"name": name, "key": secret})
            return
        ui.out(f"created key {name!r}; store it now, it is not shown again:")
        ui.out(secret)

    @keys.command("list")
    def list_(
        output: Annotated[
            ListOutput, typer.Option("--output", "-o", help="table or json.")
        ] = ListOutput.TABLE,
    ) -> None:
        """List keys (names, prefixes, limits; never the keys)."""
        with open_state() as store:
            records = sorted(store.list_api_keys(), key=lambda r: r.name)
        if output is ListOutput.JSON:
            ui.print_json([r.model_dump(exclude={"key_hash"}) for r in records])
            return
        rows = [_row(r, time.time()) for r in records]
        ui.table(["name", "prefix", "models", "rpm", "tpm", "daily", "expires (UTC)", "state"], rows)

    @keys.command("revoke")
    def revoke(
        name: Annotated[str, typer.Argument(help="Name of the key.")],
        yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    ) -> None:
        """Revoke a key; gateways refuse it within their key-cache TTL (5 s by default)."""
        with open_state() as store:
            record = store.get_api_key_by_name(name)
            if record is None:
                raise NotFoundError(f"no key named {name!r}", hint="llmctl keys list")
            if not ui.confirm(f"revoke key {name!r}? Its clients are refused from then on", assume_yes=yes):
                ui.out("nothing changed")
                raise typer.Exit(1)
            from controlplane.cli.audit import audited

            with audited(store, "keys.revoke", name):
                if not record.revoked:
                    store.put_api_key(record.model_copy(update={"revoked": True}))
        ui.out(f"revoked key {name!r}")
