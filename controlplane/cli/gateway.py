"""`llmctl gateway`: serve the OpenAI-compatible gateway (uvicorn, production settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add ``llmctl gateway`` to ``app``."""

    @app.command("gateway")
    def gateway(
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
    ) -> None:
        """Serve /v1/* with auth, limits, validation and routing to the ready replicas."""
        import logging

        from controlplane.gateway.server import serve
        from controlplane.settings import load_settings

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        settings = load_settings()
        serve(
            settings,
            host=host or settings.gateway_host,
            port=port or settings.gateway_port,
            workers=workers,
            config_path=config,
        )
