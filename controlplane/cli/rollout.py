"""``llmctl rollout NAME --set KEY=VALUE …`` and ``llmctl rollout status|promote|abort NAME``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controlplane.cli import ui
from controlplane.cli.runtime import InventoryOpt, StatusFormat, _age, _deployer
from controlplane.errors import UserError

if TYPE_CHECKING:
    from controlplane.controller import Deployer
    from controlplane.spec import ReplicaRecord, RolloutRecord

__all__ = ["register", "rollout_document"]

_ACTIONS = ("status", "promote", "abort")


def _parse_steps(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(p.strip().rstrip("%")) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UserError(
            f"--steps {text!r} must be percentages separated by commas", hint="e.g. 10,50,100"
        ) from None


def rollout_document(rollout: RolloutRecord, replicas: list[ReplicaRecord]) -> dict[str, Any]:
    """The JSON of ``llmctl rollout status -o json``: the record and each version's replicas."""
    doc = rollout.model_dump(mode="json", exclude={"stable", "canary"})
    doc["weight"] = rollout.weight
    versions = []
    for role, version in (("stable", rollout.stable_version), ("canary", rollout.canary_version)):
        mine = [r for r in replicas if (r.version == rollout.canary_version) is (role == "canary")]
        versions.append(
            {
                "role": role,
                "version": version,
                "weight": rollout.weight if role == "canary" else 100 - rollout.weight,
                "replicas": [{"id": r.id, "state": r.state.value, "node": r.node} for r in mine],
            }
        )
    doc["versions"] = versions
    return doc


def _show(deployer: Deployer, rollout: RolloutRecord, output: StatusFormat) -> None:
    from controlplane.controller.rollout import _changed

    replicas = deployer.store.list_replicas(rollout.deployment)
    doc = rollout_document(rollout, replicas)
    if output is StatusFormat.JSON:
        ui.print_json(doc)
        return
    now = time.time()
    weight = rollout.weight
    ui.out(
        f"{rollout.deployment}: rollout {rollout.status.value}, step {rollout.step + 1} of "
        f"{len(rollout.steps)} ({', '.join(f'{w}%' for w in rollout.steps)}), started "
        f"{_age(rollout.started_at, now)} ago"
    )
    ui.out(f"change: {', '.join(_changed(rollout.stable, rollout.canary))}")
    numbers = rollout.comparison

    def num(key: str, kind: str) -> str:
        value = numbers.get(key)
        if value is None:
            return "-"
        return {"s": f"{value:.3f}s", "%": f"{value:.1%}", "n": f"{value:.0f}"}[kind]

    rows = []
    for v in doc["versions"]:
        role = v["role"]
        ready = sum(1 for r in v["replicas"] if r["state"] == "ready")
        rows.append(
            [
                v["version"],
                role,
                f"{v['weight']}%" if rollout.active else "-",
                f"{ready}/{len(v['replicas'])}",
                ", ".join(r["id"] for r in v["replicas"]) or "-",
                num(f"{role}_requests", "n"),
                num(f"{role}_error_ratio", "%"),
                num(f"{role}_ttft_p95_s", "s"),
            ]
        )
    ui.table(["VERSION", "ROLE", "WEIGHT", "READY", "REPLICAS", "REQUESTS", "ERRORS", "TTFT P95"], rows)
    if rollout.reason:
        ui.out(f"last decision: {rollout.reason}")
    if not weight and rollout.active:
        ui.out("the canary takes no traffic while the old version is brought back")


def register(app: typer.Typer) -> None:
    """Add ``rollout``."""

    @app.command()
    def rollout(  # noqa: PLR0917 - Typer maps each CLI option to a parameter
        first: Annotated[str, typer.Argument(metavar="NAME | status|promote|abort NAME", help="Deployment.")],
        second: Annotated[str | None, typer.Argument(metavar="[NAME]", show_default=False)] = None,
        set_: Annotated[
            list[str] | None,
            typer.Option(
                "--set",
                help="What the new version changes: engine_args.NAME=V, source=PATH, sources.VARIANT=PATH, "
                "or another deployment field (repeatable).",
            ),
        ] = None,
        steps: Annotated[
            str | None,
            typer.Option(help="Canary traffic shares in percent, ending at 100 (default 10,50,100)."),
        ] = None,
        timeout: Annotated[float, typer.Option(help="Seconds to wait for replicas of a step.")] = 900.0,
        drain_timeout: Annotated[
            str, typer.Option(help="How long a replaced replica's in-flight requests may finish (120s, 5m).")
        ] = "120s",
        inventory: InventoryOpt = None,
        output: Annotated[StatusFormat, typer.Option("--output", "-o")] = StatusFormat.TABLE,
    ) -> None:
        """Roll a new version of a deployment out as a canary: `llmctl rollout NAME --set KEY=VALUE`
        starts it with the first step's share of traffic; the controller compares it with the running
        version (TTFT p95, error ratio) and promotes it step by step or rolls it back. `status` shows
        versions, weights and the comparison; `promote` forces the next step; `abort` rolls back."""
        from controlplane.cli.audit import audited, parse_duration
        from controlplane.controller import rollout as rollouts

        if first in _ACTIONS and second is not None:
            action, name = first, second
        elif second is not None:
            raise UserError(
                f"unknown rollout action {first!r}", hint=f"use one of {', '.join(_ACTIONS)}, or NAME --set …"
            )
        else:
            action, name = "start", first
        if action != "start" and (set_ or steps):
            raise UserError(f"--set and --steps start a rollout; `llmctl rollout {action}` takes neither")
        drain = parse_duration(drain_timeout, "--drain-timeout")
        with ui.progress() as bar, _deployer(inventory, progress=bar.update) as deployer:
            if action == "status":
                record = rollouts.get_rollout(deployer, name, active=False)
                _show(deployer, record, output)
                return
            with audited(deployer.store, f"rollout.{action}", name, {"set": ",".join(set_ or [])}):
                if action == "start":
                    current = deployer.store.get_deployment(name)
                    if current is None:
                        rollouts.get_rollout(deployer, name)  # the one-line "no deployment named …"
                        return
                    canary = rollouts.apply_sets(current.spec, set_ or [])
                    record = rollouts.start_rollout(
                        deployer,
                        name,
                        canary,
                        steps=_parse_steps(steps),
                        timeout=timeout,
                        drain_timeout=drain,
                    )
                elif action == "promote":
                    record = rollouts.get_rollout(deployer, name)
                    if record.step + 1 == len(record.steps):
                        rollouts.converge(deployer, name, wait=True, timeout=timeout, drain_timeout=drain)
                    record = rollouts.promote(deployer, name, reason="forced by llmctl rollout promote")
                    record, _ = rollouts.converge(
                        deployer, name, wait=True, timeout=timeout, drain_timeout=drain
                    )
                else:
                    rollouts.abort(deployer, name, reason="aborted by llmctl rollout abort")
                    record, _ = rollouts.converge(
                        deployer, name, wait=True, timeout=timeout, drain_timeout=drain
                    )
            _show(deployer, record, output)
