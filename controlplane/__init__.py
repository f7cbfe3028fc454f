"""Sarv control plane: fleet, catalog, placement, engines, launchers, state, gateway, ``llmctl``."""

__version__ = "0.1.0"

__all__ = ["__version__"]
