"""Fixtures of the gateway tests (defined in fixtures/gateway.py, shared with bench/gateway)."""

from fixtures.gateway import gateway_factory, module_gateways, module_sims

__all__ = ["gateway_factory", "module_gateways", "module_sims"]
