"""`llmctl controller run`: the reconcile loop the ``sarv-controller.service`` unit runs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from controlplane.cli import ui

if TYPE_CHECKING:
    from contextlib import ExitStack

    from controlplane.controller.deploy import Deployer
    from controlplane.controller.reconcile import ControllerConfig, PassReport, Reconciler
    from controlplane.settings import Settings
    from controlplane.spec import Fleet
    from controlplane.state.base import StateStore

__all__ = ["register"]

_METRICS_PORT = 9106
"""Next to node_exporter (9100) and the DCGM exporter (9400-range) without clashing with either."""


def _summary(report: PassReport) -> None:
    if not report.leader:
        ui.out("not the leader: another controller holds the lease")
        return
    ui.out(f"probed {report.probed} replica(s) in {report.seconds:.2f}s")
    for rid in report.changed:
        ui.out(f"changed {rid}")
    if report.targets_written:
        ui.out("targets file updated")
    for name, d in sorted(report.decisions.items()):
        done = "scaled" if name in report.scaled else "recommend"
        ui.out(f"{name}: {d.current} -> {d.recommended} replica(s), {done} ({d.reason})")
    for rid in report.restarted:
        ui.out(f"restarted {rid}")


async def _serve(reconciler: Reconciler, once: bool) -> PassReport | None:
    import asyncio
    import signal

    if once:
        return await reconciler.run_once()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await reconciler.run(stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return None


def _open(
    config: ControllerConfig, settings: Settings, inventory: Path | None, resources: ExitStack
) -> tuple[StateStore, Deployer | None, Fleet | None]:
    """The store, the deployer when the controller acts, and the fleet (None: no node series)."""
    import logging

    from controlplane.cli.runtime import _deployer
    from controlplane.errors import SarvError
    from controlplane.fleet import load_fleet
    from controlplane.state import open_store

    # Acting (scaling, restarts) needs the fleet and the launchers: the deployer `llmctl deploy` uses.
    if config.act:
        deployer = resources.enter_context(_deployer(inventory))
        return deployer.store, deployer, deployer.fleet
    store = open_store(settings.resolved_state_url, settings)
    resources.callback(store.close)
    try:
        fleet = load_fleet(settings.inventory)
    except SarvError as exc:  # the controller still probes; only the node series are left out
        logging.getLogger("controlplane.controller").warning(
            "fleet not loaded, no sarv_node_* series: %s", exc
        )
        return store, None, None
    return store, None, fleet


def _run(
    config: ControllerConfig, *, once: bool, metrics_host: str, metrics_port: int, inventory: Path | None
) -> None:
    import asyncio
    import logging
    from contextlib import ExitStack

    import httpx

    from controlplane.controller.lease import open_lease
    from controlplane.controller.reconcile import ControllerMetrics, Reconciler, serve_metrics
    from controlplane.errors import SarvError
    from controlplane.settings import load_settings
    from controlplane.state import redact_url

    log = logging.getLogger("controlplane.controller")
    settings = load_settings(inventory=inventory)
    url = settings.resolved_state_url
    resources = ExitStack()
    store, deployer, fleet = _open(config, settings, inventory, resources)
    lease, close_lease = open_lease(url, settings, ttl_s=config.lease_ttl_s)
    metrics = ControllerMetrics()
    stop_metrics = serve_metrics(metrics, metrics_host, metrics_port) if metrics_port else None
    log.info(
        "controller %s on %s, every %.1fs, targets %s, %s",
        lease.holder,
        redact_url(url),
        config.period_s,
        config.targets_file or "off",
        "acting" if deployer is not None else "recommending only",
    )

    async def main() -> PassReport | None:
        timeout = httpx.Timeout(config.probe_timeout_s)
        # Replicas sit on the fleet's private addresses: never route probes through an HTTP proxy.
        async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
            reconciler = Reconciler(
                store=store,
                client=client,
                config=config,
                lease=lease,
                metrics=metrics,
                fleet=fleet,
                deployer=deployer,
            )
            try:
                return await _serve(reconciler, once)
            finally:
                reconciler.release()

    try:
        report = asyncio.run(main())
    finally:
        if stop_metrics is not None:
            stop_metrics()
        close_lease()
        resources.close()
    if report is None:
        log.info("controller stopped")
        return
    _summary(report)
    if not report.leader:
        raise SarvError(
            "another controller holds the lease; nothing done",
            hint="llmctl controller run --once acts only as the leader",
        )
    if report.failed_phases:
        raise SarvError(f"controller pass failed in: {', '.join(report.failed_phases)} (see the log above)")


def register(app: typer.Typer) -> None:
    """Add ``llmctl controller …`` to ``app``."""
    controller = typer.Typer(
        help="The controller: health of replicas, Prometheus targets, autoscaling, restarts.",
        no_args_is_help=True,
    )
    app.add_typer(controller, name="controller")

    @controller.command("run")
    def run(  # noqa: PLR0917 - Typer maps each CLI option to a parameter
        once: Annotated[bool, typer.Option("--once", help="Run one pass and exit (1 if it failed).")] = False,
        config_file: Annotated[
            Path | None,
            typer.Option("--config", "-c", help="Controller YAML (periods, thresholds, autoscale policies)."),
        ] = None,
        period: Annotated[
            float | None, typer.Option("--period", min=0.01, help="Seconds between passes (default 5).")
        ] = None,
        targets_file: Annotated[
            Path | None,
            typer.Option(
                "--targets-file",
                envvar="SARV_PROMETHEUS_TARGETS",
                help="Prometheus file_sd file of the ready replicas (default: none written).",
            ),
        ] = None,
        failure_threshold: Annotated[
            int | None,
            typer.Option(
                min=1, help="Failed health checks in a row before a replica is unhealthy (default 3)."
            ),
        ] = None,
        probe_timeout: Annotated[
            float | None, typer.Option(min=0.01, help="Seconds one replica's probe may take (default 2).")
        ] = None,
        lease_ttl: Annotated[
            float | None,
            typer.Option(min=0.1, help="Seconds a standby waits after the leader stops (default 15)."),
        ] = None,
        act: Annotated[
            bool | None,
            typer.Option(
                "--act/--recommend-only",
                help="Scale deployments and restart replicas (default), or only recommend and export.",
            ),
        ] = None,
        inventory: Annotated[
            Path | None,
            typer.Option(
                "--inventory", "-i", envvar="SARV_INVENTORY", help="Fleet the controller places on."
            ),
        ] = None,
        metrics_host: Annotated[str, typer.Option(help="Address of the /metrics endpoint.")] = "127.0.0.1",
        metrics_port: Annotated[
            int | None,
            typer.Option(
                min=0,
                max=65535,
                help="Port of the /metrics endpoint; 0 turns it off (default 9106, 0 with --once).",
            ),
        ] = None,
    ) -> None:
        """Probe replicas, mark them ready/unhealthy, write targets, scale deployments, heal replicas."""
        import logging

        from controlplane.controller.reconcile import load_controller_config

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        config = load_controller_config(
            config_file,
            period_s=period,
            targets_file=targets_file,
            failure_threshold=failure_threshold,
            probe_timeout_s=probe_timeout,
            lease_ttl_s=lease_ttl,
            act=act,
        )
        port = metrics_port if metrics_port is not None else (0 if once else _METRICS_PORT)
        _run(config, once=once, metrics_host=metrics_host, metrics_port=port, inventory=inventory)
