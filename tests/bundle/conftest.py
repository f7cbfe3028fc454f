"""Bundle fixtures (tests/fixtures/bundles.py)."""

from fixtures.bundles import built, kit

__all__ = ["built", "kit"]
