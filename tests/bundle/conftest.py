"""Bundle fixtures (tests/fixtures/bundles.py)."""

from fixtures.bundles import built, kit, site_built

__all__ = ["built", "kit", "site_built"]
