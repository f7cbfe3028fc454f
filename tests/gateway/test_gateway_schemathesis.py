"""Property-based requests generated from the gateway's own OpenAPI document: never a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")
from fixtures.gateway import add_key, add_replica, make_store  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from controlplane.gateway.schemas import openapi_document  # noqa: E402

schema = schemathesis.openapi.from_dict(openapi_document())


@pytest.fixture(scope="module")
def live(tmp_path_factory, module_sims, module_gateways):
    sim = module_sims(served_model_name="m1", latency_mode="fixed", fixed_ttft_ms=1, fixed_output_tokens=2)
    store = make_store(tmp_path_factory.mktemp("st"))
    add_replica(store, sim.url, "m1", rid="m1-0")
    key = add_key(store, "fuzz")
    return module_gateways(store), key


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, live):
    gw, key = live
    case.call_and_validate(
        base_url=gw.url, headers={"Authorization": f"Bearer {key}"}, checks=[not_a_server_error], timeout=30
    )
