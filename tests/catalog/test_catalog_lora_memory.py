"""The estimator's LoRA term: vLLM's slot buffers on every linear layer, worked out by hand for Llama-3-8B."""

from __future__ import annotations

import pytest

from controlplane.catalog import Catalog, estimate, lora_budget, lora_slots_mib
from controlplane.spec import DeploymentSpec, LoraAdapter


def test_llama_8b_four_rank_16_slots_take_320_mib_on_one_gpu() -> None:
    model = Catalog.load().get("llama-3-8b")
    # Per layer, elements × max_loras 4 × 2 bytes: qkv 3·16·4096 + 16·(4096 + 2·1024), o 16·4096 + 16·4096,
    # gate_up 2·16·4096 + 16·2·14336, down 16·14336 + 16·4096 → 1,310,720 × 8 B = 10 MiB; × 32 layers.
    assert lora_slots_mib(model, max_loras=4, max_lora_rank=16) == pytest.approx(320.0)
    # tp splits lora_b of column-parallel and lora_a of row-parallel layers only.
    assert 160.0 < lora_slots_mib(model, max_loras=4, max_lora_rank=16, tp=2) < 320.0
    assert lora_slots_mib(model, max_loras=4, max_lora_rank=16, pp=2) == pytest.approx(160.0)


def test_the_term_enters_the_fit_and_the_explanation() -> None:
    model = Catalog.load().get("llama-3-8b")
    base = estimate(model, gpu_memory_mib=81920, max_model_len=8192)
    with_lora = estimate(model, gpu_memory_mib=81920, max_model_len=8192, max_loras=4, max_lora_rank=16)
    assert with_lora.required_mib - base.required_mib == pytest.approx(320.0)
    assert not any("LoRA" in line for line in base.explain())
    [line] = [ln for ln in with_lora.explain() if "LoRA slots" in ln]
    assert "0.31 GiB" in line and "max_loras 4 × max_lora_rank 16" in line


def test_a_deployment_has_a_lora_budget_only_with_lora_on() -> None:
    assert lora_budget(DeploymentSpec(name="a", model="m")) == {}
    assert lora_budget(DeploymentSpec(name="a", model="m", lora_adapters=[LoraAdapter(name="x")])) == {
        "max_loras": 1,
        "max_lora_rank": 16,
    }
    spec = DeploymentSpec(
        name="a", model="m", engine_args={"enable_lora": True, "max_loras": 8, "max_lora_rank": 64}
    )
    assert lora_budget(spec) == {"max_loras": 8, "max_lora_rank": 64}
