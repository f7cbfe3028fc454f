"""Bundle fixtures (tests/fixtures/bundles.py) and the site registry (tests/fixtures/registry.py)."""

from fixtures.bundles import built, kit, site_built
from fixtures.registry import site_registry

__all__ = ["built", "kit", "site_built", "site_registry"]
