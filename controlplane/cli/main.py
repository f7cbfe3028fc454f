"""``llmctl`` entry point: builds the Typer app and turns every Sarv error into one line and an exit code."""

from __future__ import annotations

import sys

import click
import typer
from pydantic import ValidationError

from controlplane import __version__
from controlplane.cli import (
    audit,
    bundle,
    controller,
    fleet,
    gateway,
    infra,
    keys,
    operations,
    planning,
    rollout,
    runtime,
    teams,
    ui,
    usage,
)
from controlplane.errors import SarvError, describe_validation_error

__all__ = ["build_app", "main"]


def _version(value: bool) -> None:
    if value:
        ui.out(f"llmctl (sarv) {__version__}")
        raise typer.Exit()


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="llmctl",
        help="Plan, deploy, route and observe LLM replicas on your own GPU servers.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ) -> None:
        """Sarv's control plane."""

    modules = (
        fleet,
        planning,
        runtime,
        operations,
        rollout,
        keys,
        teams,
        audit,
        usage,
        gateway,
        infra,
        controller,
        bundle,
    )
    for module in modules:
        module.register(app)
    return app


def main(argv: list[str] | None = None) -> None:
    """Run ``llmctl``; exits with 0, 2 (bad input) or the failing :class:`SarvError`'s code."""
    app = build_app()
    try:
        rv = app(args=argv, standalone_mode=False, prog_name="llmctl")
    except SarvError as exc:
        ui.error(str(exc))
        sys.exit(exc.exit_code)
    except ValidationError as exc:
        ui.error(describe_validation_error(exc))
        sys.exit(2)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        ui.error(exc.format_message())
        sys.exit(exc.exit_code)
    # typer >= 0.24 vendors click (typer._click): its usage errors and exits are not click's classes.
    except typer.TyperException as exc:
        ui.error(exc.format_message())
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        ui.error("aborted")
        sys.exit(130)
    except PermissionError as exc:
        # A file or directory this user may not write (a cache or state dir made by another user, root).
        where = exc.filename or "a file"
        ui.error(
            f"permission denied: {where}: run llmctl as the user that owns it, "
            "or point the setting (model_cache, home, state_url) at a directory this user owns"
        )
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
