"""`llmctl gateway`: serve the OpenAI-compatible gateway (uvicorn, production settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add ``llmctl gateway`` to ``app``."""

    @app.command("gateway")
    def gateway(  # noqa: PLR0917 - Typer maps each CLI option to a parameter
        host: Annotated[
            str | None, typer.Option(help="Address to listen on (default: settings.gateway_host).")
        ] = None,
        port: Annotated[
            int | None, typer.Option(min=1, max=65535, help="Port (default: settings.gateway_port).")
        ] = None,
        workers: Annotated[
            int, typer.Option(min=1, max=256, help="Worker processes (>1 needs Redis state).")
        ] = 1,
        config: Annotated[
            Path | None,
            typer.Option(
                "--config", "-c", help="Gateway YAML (limits, routing, guardrails); see docs/gateway.md."
            ),
        ] = None,
        tls_cert: Annotated[
            Path | None,
            typer.Option(help="PEM certificate chain: serve HTTPS (default: settings.gateway_tls_cert)."),
        ] = None,
        tls_key: Annotated[
            Path | None, typer.Option(help="Its PEM private key (default: settings.gateway_tls_key).")
        ] = None,
        tls_client_ca: Annotated[
            Path | None,
            typer.Option(
                help="Require client certificates signed by this CA (settings.gateway_tls_client_ca)."
            ),
        ] = None,
        metrics_host: Annotated[
            str | None,
            typer.Option(help="Address of the /metrics listener (default: settings.gateway_metrics_host)."),
        ] = None,
        metrics_port: Annotated[
            int | None,
            typer.Option(
                min=0,
                max=65535,
                help="Port of the /metrics listener, 0 for none (settings.gateway_metrics_port).",
            ),
        ] = None,
    ) -> None:
        """Serve /v1/* with auth, limits, validation and routing to the ready replicas.

        /metrics is served on a separate listener (loopback:9107 by default). With a certificate and key
        the API is HTTPS; SIGHUP reloads them without closing the listener.
        """
        import logging

        from controlplane.gateway.server import serve
        from controlplane.gateway.tls import tls_files
        from controlplane.settings import load_settings

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        settings = load_settings(gateway_metrics_host=metrics_host, gateway_metrics_port=metrics_port)
        tls = tls_files(
            tls_cert or settings.gateway_tls_cert,
            tls_key or settings.gateway_tls_key,
            tls_client_ca or settings.gateway_tls_client_ca,
        )
        serve(
            settings,
            host=host or settings.gateway_host,
            port=port or settings.gateway_port,
            workers=workers,
            config_path=config,
            tls=tls,
        )
