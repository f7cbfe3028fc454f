"""The per-GPU memory estimator: weights share, KV cache split by tp/pp, overhead, max concurrency."""

from __future__ import annotations

import math

import pytest

from controlplane.catalog import (
    CUDA_GRAPH_MIB,
    NCCL_MIB,
    NON_TORCH_MIB,
    Catalog,
    estimate,
    kv_bytes_per_token,
)
from controlplane.errors import UserError
from controlplane.spec import ModelSpec, Quantization

MIB = 1 << 20


@pytest.fixture(scope="module")
def cat() -> Catalog:
    return Catalog.load()


def test_kv_split_by_tp_and_pp(cat: Catalog) -> None:
    m = cat.get("llama-70b")  # 80 layers, 8 KV heads, head_dim 128
    assert kv_bytes_per_token(m, tp=2) == 327_680 // 2
    assert kv_bytes_per_token(m, tp=8) == 327_680 // 8
    assert kv_bytes_per_token(m, pp=2) == 327_680 // 2
    assert kv_bytes_per_token(m, pp=3) == 2 * 27 * 8 * 128 * 2  # the largest stage has ceil(80/3) layers


def test_kv_heads_replicated_beyond_kv_heads(cat: Catalog) -> None:
    m = cat.get("llama-70b")
    # tp=16 > 8 KV heads: every GPU still keeps one whole KV head.
    assert kv_bytes_per_token(m, tp=16) == kv_bytes_per_token(m, tp=8) == 2 * 80 * 1 * 128 * 2


def test_fp8_kv_cache_halves_it(cat: Catalog) -> None:
    assert kv_bytes_per_token(cat.get("llama-3-8b"), kv_cache_dtype="fp8") == 65_536


def test_weights_share(cat: Catalog) -> None:
    m = cat.get("llama-3-8b")
    one = estimate(m, gpu_memory_mib=81920)
    assert one.weights_mib == pytest.approx(m.num_params * 2 / MIB)
    two = estimate(m, tp=2, gpu_memory_mib=81920)
    assert two.weights_mib == pytest.approx(one.weights_mib / 2)
    # pp=2: half the layers plus one of embedding / LM head on the largest stage.
    pp2 = estimate(m, pp=2, gpu_memory_mib=81920)
    embed = m.vocab_size * m.hidden_size
    layer = (m.num_params - 2 * embed) / m.num_layers
    assert pp2.weights_mib == pytest.approx((16 * layer + embed) * 2 / MIB)


def test_quantized_variants_shrink_weights_but_not_embeddings(cat: Catalog) -> None:
    m = cat.get("llama-70b")
    sizes = {
        q: estimate(m, tp=4, gpu_memory_mib=81920, quantization=q).weights_mib
        for q in Quantization
        if q is not Quantization.AUTO
    }
    assert (
        sizes[Quantization.NONE]
        > sizes[Quantization.FP8]
        == sizes[Quantization.INT8]
        > sizes[Quantization.AWQ]
    )
    assert sizes[Quantization.AWQ] == sizes[Quantization.GPTQ]
    embed = 2 * m.vocab_size * m.hidden_size
    linear = m.num_params - embed
    assert sizes[Quantization.FP8] == pytest.approx((linear * 1 + embed * 2) / 4 / MIB)


def test_overhead_terms(cat: Catalog) -> None:
    m = cat.get("llama-3-8b")
    single = estimate(m, gpu_memory_mib=81920)
    assert single.non_torch_mib == NON_TORCH_MIB
    assert single.cuda_graph_mib == CUDA_GRAPH_MIB
    assert estimate(m, tp=2, gpu_memory_mib=81920).non_torch_mib == NON_TORCH_MIB + NCCL_MIB
    bigger_batch = estimate(m, gpu_memory_mib=81920, max_num_batched_tokens=16384)
    assert bigger_batch.activation_mib == pytest.approx(2 * single.activation_mib)


def test_llama_70b_tp2_on_80gb(cat: Catalog) -> None:
    est = estimate(cat.get("llama-70b"), tp=2, gpu_memory_mib=81920, gpu_model="A100-SXM4-80GB")
    assert est.budget_mib == pytest.approx(0.9 * 81920)
    assert est.kv_bytes_per_token == 327_680
    assert est.kv_bytes_per_token_per_gpu == 163_840
    assert est.kv_per_sequence_mib == pytest.approx(8192 * 163_840 / MIB)
    assert est.fits
    assert est.max_concurrency == math.floor(est.kv_budget_mib / est.kv_per_sequence_mib)
    assert est.max_concurrency >= 1


def test_concurrency_target_drives_the_fit(cat: Catalog) -> None:
    m = cat.get("llama-70b")
    base = estimate(m, tp=2, gpu_memory_mib=81920)
    at_max = estimate(m, tp=2, gpu_memory_mib=81920, concurrency=base.max_concurrency)
    over = estimate(m, tp=2, gpu_memory_mib=81920, concurrency=base.max_concurrency + 1)
    assert at_max.fits
    assert not over.fits
    assert over.required_mib == pytest.approx(
        base.required_mib + base.max_concurrency * base.kv_per_sequence_mib
    )


def test_utilization_lowers_the_budget(cat: Catalog) -> None:
    m = cat.get("llama-70b")
    assert estimate(m, tp=2, gpu_memory_mib=81920, gpu_memory_utilization=0.9).fits
    assert not estimate(m, tp=2, gpu_memory_mib=81920, gpu_memory_utilization=0.8).fits


def test_kv_rounds_up_to_16_token_blocks(cat: Catalog) -> None:
    m = cat.get("sarv-tiny")
    est = estimate(m, gpu_memory_mib=1024, max_model_len=1000)
    assert est.kv_per_sequence_mib == pytest.approx(1008 * kv_bytes_per_token(m) / MIB)


def test_too_small_gpu_has_zero_concurrency(cat: Catalog) -> None:
    est = estimate(cat.get("llama-70b"), gpu_memory_mib=24576)
    assert not est.fits
    assert est.max_concurrency == 0


def test_explain_shows_the_arithmetic(cat: Catalog) -> None:
    text = "\n".join(estimate(cat.get("llama-70b"), tp=2, gpu_memory_mib=81920).explain())
    assert "327,680 B" in text
    assert "163,840 B" in text
    assert "0.90 × 80.0 GiB" in text
    assert "max concurrency" in text


def test_bad_inputs(cat: Catalog) -> None:
    m: ModelSpec = cat.get("llama-3-8b")
    with pytest.raises(UserError, match="exceeds llama-3-8b's 32 layers"):
        estimate(m, pp=33, gpu_memory_mib=81920)
    with pytest.raises(UserError, match="auto"):
        estimate(m, gpu_memory_mib=81920, quantization=Quantization.AUTO)
    with pytest.raises(UserError, match="kv_cache_dtype"):
        estimate(m, gpu_memory_mib=81920, kv_cache_dtype="int3")
