"""`llmctl infra` commands: plan, apply and destroy a Terraform configuration and export its inventory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from controlplane.cli import ui
from controlplane.errors import UserError

if TYPE_CHECKING:
    from controlplane.terraform import ChangeSummary, RunResult, Terraform, TerraformEvent

__all__ = ["register"]

_Dir = Annotated[
    Path,
    typer.Option(
        "--dir",
        "-C",
        help="Terraform root configuration (e.g. a copy of infra/modules/static/examples/basic).",
        file_okay=False,
    ),
]
_VarFiles = Annotated[
    list[Path] | None,
    typer.Option(
        "--var-file",
        help="Terraform variables file (.tfvars or .tfvars.json); repeatable. Variables are never taken as "
        "arguments, so nothing secret reaches the process list.",
        dir_okay=False,
    ),
]
_Binary = Annotated[
    str | None, typer.Option("--terraform", help="Path of the terraform binary (default: PATH).")
]
_Timeout = Annotated[
    float, typer.Option("--timeout", min=1.0, help="Seconds each terraform command may run.")
]

# Events worth a progress line; the rest (version, log lines, outputs) only clutter the display.
_SHOWN = {"planned_change", "apply_start", "apply_progress", "apply_complete", "apply_errored", "init_output"}


def _terraform(
    workdir: Path,
    binary: str | None,
    timeout_s: float,
    on_event: Callable[[TerraformEvent], None] | None = None,
) -> Terraform:
    from controlplane.terraform import Terraform

    return Terraform(workdir, binary=binary, timeout_s=timeout_s, on_event=on_event)


def _summary_line(summary: ChangeSummary | None) -> str:
    if summary is None:
        return "no changes reported"
    return f"{summary.add} to add, {summary.change} to change, {summary.remove} to destroy"


def _report(result: RunResult) -> None:
    for warning in result.warnings:
        ui.warn(warning)


def _run_steps(
    workdir: Path, binary: str | None, timeout_s: float, steps: list[str], var_files: list[Path]
) -> list[RunResult]:
    """Run init then ``steps`` with one progress display; each event becomes a line keyed by resource."""
    results: list[RunResult] = []
    with ui.progress() as bar:

        def on_event(event: TerraformEvent) -> None:
            if event.type not in _SHOWN or not event.message:
                return
            bar.update(event.address or event.type, event.message)

        tf = _terraform(workdir, binary, timeout_s, on_event)
        results.append(tf.init())
        for step in steps:
            if step == "plan":
                results.append(tf.plan(var_files, save=True))
            elif step == "apply":
                results.append(tf.apply(var_files, use_saved_plan=True))
            elif step == "plan-only":
                results.append(tf.plan(var_files))
            elif step == "destroy":
                results.append(tf.destroy(var_files))
    for result in results:
        _report(result)
    return results


def register(app: typer.Typer) -> None:
    """Add the ``infra`` command group to ``app``."""
    infra = typer.Typer(
        name="infra",
        help="Provision machines with Terraform (infra/modules) and export the Ansible inventory.",
        no_args_is_help=True,
    )
    app.add_typer(infra, name="infra")

    @infra.command("plan")
    def plan(
        workdir: _Dir = Path(),
        var_file: _VarFiles = None,
        terraform: _Binary = None,
        timeout: _Timeout = 3600.0,
    ) -> None:
        """Show what `apply` would change (terraform init + plan); changes nothing."""
        results = _run_steps(workdir, terraform, timeout, ["plan-only"], list(var_file or []))
        ui.out(f"Plan: {_summary_line(results[-1].summary)}.")

    @infra.command("apply")
    def apply(
        workdir: _Dir = Path(),
        var_file: _VarFiles = None,
        terraform: _Binary = None,
        timeout: _Timeout = 3600.0,
        inventory: Annotated[
            Path | None,
            typer.Option(
                "--inventory", "-o", help="Also write the resulting Ansible inventory to this file."
            ),
        ] = None,
    ) -> None:
        """Create or update the machines (terraform init + plan + apply of exactly that plan)."""
        results = _run_steps(workdir, terraform, timeout, ["plan", "apply"], list(var_file or []))
        ui.out(f"Applied: {_summary_line(results[-1].summary)}.")
        if inventory is not None:
            from controlplane.terraform import write_inventory

            text = _terraform(workdir, terraform, timeout).inventory()
            ui.out(f"Inventory written to {write_inventory(text, inventory)}")

    @infra.command("destroy")
    def destroy(
        workdir: _Dir = Path(),
        var_file: _VarFiles = None,
        terraform: _Binary = None,
        timeout: _Timeout = 3600.0,
        yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    ) -> None:
        """Destroy every resource of the configuration (terraform destroy)."""
        if not yes:
            import sys

            if not sys.stdin.isatty():
                raise UserError(
                    f"refusing to destroy {workdir.resolve()} without confirmation",
                    hint="pass --yes to confirm",
                )
            typer.confirm(f"Destroy everything Terraform manages in {workdir.resolve()}?", abort=True)
        results = _run_steps(workdir, terraform, timeout, ["destroy"], list(var_file or []))
        ui.out(f"Destroyed: {results[-1].summary.remove if results[-1].summary else 0} resource(s).")

    @infra.command("inventory")
    def inventory(
        workdir: _Dir = Path(),
        output: Annotated[
            Path | None,
            typer.Option("--output", "-o", help="Write the inventory to this file (default: print it)."),
        ] = None,
        name: Annotated[str, typer.Option("--name", help="Terraform output to read.")] = "inventory",
        terraform: _Binary = None,
        timeout: _Timeout = 3600.0,
    ) -> None:
        """Print or write the Ansible inventory of an applied configuration (usable with `llmctl … -i`)."""
        text = _terraform(workdir, terraform, timeout).inventory(name)
        if output is None:
            ui.out(text.rstrip("\n"))
            return
        from controlplane.terraform import write_inventory

        ui.out(f"Inventory written to {write_inventory(text, output)}")
