"""`llmctl` commands that change running deployments and nodes: scale, apply, cordon, uncordon, drain,
and the events they leave (``llmctl events``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controlplane.cli import ui
from controlplane.cli.runtime import InventoryOpt, StatusFormat, _age, _deployer
from controlplane.errors import PlacementError, UserError

if TYPE_CHECKING:
    from controlplane.controller.apply import Change
    from controlplane.state.base import EventRecord

__all__ = ["event_rows", "register"]

_DRAIN_HELP = "How long in-flight requests may finish before a replica is stopped (120s, 5m)."


def event_rows(events: list[EventRecord], now: float) -> list[list[str]]:
    """``llmctl events`` table rows: age, type, reason, object, message."""
    return [[_age(e.at, now), e.type, e.reason, e.object or "-", e.message] for e in events]


def register(app: typer.Typer) -> None:
    """Add ``scale``, ``apply``, ``cordon``, ``uncordon``, ``drain`` and ``events``."""

    @app.command()
    def scale(  # noqa: PLR0917 - Typer maps each CLI option to a parameter
        name: Annotated[str, typer.Argument(help="Deployment name.")],
        replicas: Annotated[int, typer.Argument(help="Replica count wanted.", min=1)],
        wait: Annotated[
            bool, typer.Option("--wait/--no-wait", help="Wait until new replicas are ready.")
        ] = True,
        timeout: Annotated[float, typer.Option(help="Seconds to wait for new replicas.")] = 900.0,
        drain_timeout: Annotated[str, typer.Option(help=_DRAIN_HELP)] = "120s",
        inventory: InventoryOpt = None,
        output: Annotated[StatusFormat, typer.Option("--output", "-o")] = StatusFormat.TABLE,
    ) -> None:
        """Change a deployment's replica count in place: new replicas placed around the running ones,
        removed ones (unhealthy first, then least loaded, then youngest) drained before they stop."""
        from controlplane.cli.audit import audited, parse_duration
        from controlplane.controller.scaling import raise_unplaced
        from controlplane.controller.scaling import scale as scale_deployment

        drain = parse_duration(drain_timeout, "--drain-timeout")
        with (
            ui.progress() as bar,
            _deployer(inventory, progress=bar.update) as deployer,
            audited(deployer.store, "scale", name, {"replicas": str(replicas)}),
        ):
            result = scale_deployment(
                deployer,
                name,
                replicas,
                reason="llmctl scale",
                wait=wait,
                timeout=timeout,
                drain_timeout=drain,
            )
            if output is StatusFormat.JSON:
                ui.print_json(result.model_dump(mode="json"))
            else:
                ui.out(result.describe() if result.changed else f"{name}: unchanged ({replicas} replicas)")
            raise_unplaced(result)

    @app.command()
    def apply(
        file: Annotated[Path, typer.Option("--file", "-f", help="YAML file of deployments.")],
        dry_run: Annotated[
            bool,
            typer.Option("--dry-run", help="Print the difference with the desired state; change nothing."),
        ] = False,
        timeout: Annotated[float, typer.Option(help="Seconds to wait for new replicas.")] = 900.0,
        inventory: InventoryOpt = None,
        output: Annotated[StatusFormat, typer.Option("--output", "-o")] = StatusFormat.TABLE,
    ) -> None:
        """Bring deployments to what FILE declares (the fields of `llmctl deploy`): create, scale a
        changed replica count, or roll any other change out as a canary (`llmctl rollout status`);
        applying the same file twice changes nothing."""
        from controlplane.cli.audit import audited
        from controlplane.controller.apply import Action, load_manifest, plan_changes

        with ui.progress() as bar, _deployer(inventory, progress=bar.update) as deployer:
            changes = plan_changes(deployer, load_manifest(file, deployer))
            if output is StatusFormat.JSON and dry_run:
                ui.print_json([_change_doc(c) for c in changes])
                return
            if dry_run:
                for change in changes:
                    ui.out(change.describe())
                return
            refused = [c for c in changes if c.action is Action.REFUSED]
            if refused:
                first = refused[0]
                raise UserError(
                    f"{file}: {first.name} changes {', '.join(sorted(first.fields))} at once; the replica "
                    "counts scale and the rest rolls out, so nothing was applied",
                    hint="apply the replica counts first, then the other changes (or the other way round)",
                )
            from controlplane.controller.rollout import start_rollout

            with audited(deployer.store, "apply", str(file), {"deployments": str(len(changes))}):
                for change in changes:
                    if change.action is Action.ROLLOUT:
                        start_rollout(deployer, change.name, change.spec, timeout=timeout)
                    elif change.action is not Action.UNCHANGED:
                        deployer.deploy(change.spec, timeout=timeout)
        if output is StatusFormat.JSON:
            ui.print_json([_change_doc(c) for c in changes])
            return
        for change in changes:
            ui.out(change.describe())

    _register_nodes(app)


def _register_nodes(app: typer.Typer) -> None:
    """``cordon``, ``uncordon``, ``drain`` and ``events``."""

    @app.command()
    def cordon(
        node: Annotated[str, typer.Argument(help="Node name (see `llmctl inventory`).")],
        inventory: InventoryOpt = None,
    ) -> None:
        """Place no new replicas on NODE; those it runs keep running."""
        _schedulable(node, inventory, schedulable=False)

    @app.command()
    def uncordon(
        node: Annotated[str, typer.Argument(help="Node name.")],
        inventory: InventoryOpt = None,
    ) -> None:
        """Let NODE take new replicas again."""
        _schedulable(node, inventory, schedulable=True)

    @app.command()
    def drain(
        node: Annotated[str, typer.Argument(help="Node name.")],
        timeout: Annotated[str, typer.Option(help=_DRAIN_HELP)] = "120s",
        start_timeout: Annotated[float, typer.Option(help="Seconds to wait for replacements.")] = 900.0,
        inventory: InventoryOpt = None,
    ) -> None:
        """Cordon NODE, start its replicas' replacements elsewhere, stop routing to its replicas, let
        in-flight requests finish up to --timeout, then stop them."""
        from controlplane.cli.audit import audited, parse_duration
        from controlplane.controller.scaling import drain_node

        seconds = parse_duration(timeout, "--timeout")
        with (
            ui.progress() as bar,
            _deployer(inventory, progress=bar.update) as deployer,
            audited(deployer.store, "drain", node, {"timeout": f"{seconds:g}s"}),
        ):
            result = drain_node(deployer, node, timeout=seconds, start_timeout=start_timeout)
            for name, ids in sorted(result.replaced.items()):
                if ids:
                    ui.out(f"{name}: started {', '.join(ids)} elsewhere")
            for o in result.drained:
                late = f", {o.in_flight:.0f} request(s) cut at the timeout" if o.timed_out else ""
                ui.out(f"{o.replica}: drained in {o.seconds:.1f}s{late}, stopped")
            ui.out(f"{node}: drained and cordoned (`llmctl uncordon {node}` to use it again)")
            if result.unplaced:
                raise PlacementError(
                    f"{result.unplaced} replacement(s) for {node}'s replicas could not be placed "
                    f"and wait as pending: {result.reason}",
                    hint="free or add GPUs, or uncordon a node",
                )

    @app.command()
    def events(
        name: Annotated[str | None, typer.Argument(help="Deployment name (default: all events).")] = None,
        since: Annotated[
            str | None, typer.Option(help="From this long ago (30m, 2h) or an ISO time (UTC).")
        ] = None,
        limit: Annotated[int, typer.Option(help="At most this many, the newest.", min=1)] = 200,
        output: Annotated[StatusFormat, typer.Option("--output", "-o", help="table or json.")] = (
            StatusFormat.TABLE
        ),
    ) -> None:
        """What the controller and commands did, and why (oldest first), like `kubectl get events`."""
        from controlplane.cli.audit import parse_since
        from controlplane.cli.keys import open_state

        now = time.time()
        start = parse_since(since, now) if since else 0.0
        with open_state() as store:
            found = store.list_events(name, since=start, limit=limit)
        if output is StatusFormat.JSON:
            ui.print_json([e.model_dump(mode="json") for e in found])
            return
        if not found:
            ui.out("no events" + (f" for {name}" if name else ""))
            return
        ui.table(["AGE", "TYPE", "REASON", "OBJECT", "MESSAGE"], event_rows(found, now))


def _schedulable(node: str, inventory: Path | None, *, schedulable: bool) -> None:
    from controlplane.cli.audit import audited
    from controlplane.controller.scaling import cordon, uncordon

    action = "uncordon" if schedulable else "cordon"
    with _deployer(inventory) as deployer, audited(deployer.store, action, node):
        changed = uncordon(deployer, node) if schedulable else cordon(deployer, node)
    if changed:
        ui.out(f"{node}: {action}ed")
    else:
        ui.out(f"{node}: already {'schedulable' if schedulable else 'cordoned'}")


def _change_doc(change: Change) -> dict[str, Any]:
    return {
        "name": change.name,
        "action": change.action.value,
        "fields": {k: {"current": a, "desired": b} for k, (a, b) in change.fields.items()},
    }
