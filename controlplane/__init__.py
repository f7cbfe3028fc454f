"""Sarv control plane: fleet, catalog, placement, engines, launchers, state, gateway and the ``llmctl`` CLI."""

__version__ = "0.1.0"

__all__ = ["__version__"]
