"""The estimator's speculative-draft term: the draft's weights and KV cache on every GPU of the replica.

The draft is a Llama-3.2-1B-shaped config.json, worked out by hand: 1,235,814,400 parameters (16 layers of
attention 10,485,760 + MLP 50,331,648 + norms 4,096, tied 128,256 × 2,048 embeddings, final norm), so
2,471,628,800 B in bf16 = 2,357.1 MiB; KV per token 2 × 16 layers × 8 heads × 64 × 2 B = 32,768 B.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from placement.plan_fleets import node

from controlplane.catalog import Catalog, draft_model, estimate
from controlplane.errors import WeightsError
from controlplane.placement import place
from controlplane.spec import DeploymentSpec, Fleet, SpeculativeConfig

DRAFT_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_hidden_layers": 16,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
DRAFT_WEIGHTS_MIB = 2_471_628_800 / 2**20
DRAFT_KV_PER_TOKEN = 32_768


@pytest.fixture
def draft_dir(tmp_path: Path) -> Path:
    d = tmp_path / "Llama-3.2-1B-Instruct"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(DRAFT_CONFIG))
    return d


def _spec(draft: Path | None, **kw: object) -> DeploymentSpec:
    speculative = SpeculativeConfig(model=str(draft), num_speculative_tokens=4) if draft else None
    return DeploymentSpec(name="d", model="llama-3.1-8b", speculative=speculative, **kw)  # type: ignore[arg-type]


def test_the_draft_is_read_from_its_config_and_ngram_needs_none(draft_dir: Path) -> None:
    draft = draft_model(_spec(draft_dir))
    assert draft is not None and draft.num_params == 1_235_814_400 and draft.num_layers == 16
    assert draft_model(_spec(None)) is None
    ngram = DeploymentSpec(name="d", model="m", speculative=SpeculativeConfig.parse("ngram:4"))
    assert draft_model(ngram) is None


def test_a_draft_without_config_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "bare").mkdir()
    with pytest.raises(WeightsError, match=r"draft model .*bare.* has no config\.json"):
        draft_model(_spec(tmp_path / "bare"))


@pytest.mark.parametrize("tp", [1, 2])
def test_weights_and_kv_of_the_draft_enter_the_fit_split_by_tp(draft_dir: Path, tp: int) -> None:
    model = Catalog.load().get("llama-3.1-8b")
    draft = draft_model(_spec(draft_dir))
    kw = {"tp": tp, "gpu_memory_mib": 81920, "max_model_len": 8192, "concurrency": 4}
    base = estimate(model, **kw)  # type: ignore[arg-type]
    with_draft = estimate(model, draft=draft, **kw)  # type: ignore[arg-type]
    assert with_draft.draft_weights_mib == pytest.approx(DRAFT_WEIGHTS_MIB / tp)
    assert with_draft.draft_kv_bytes_per_token_per_gpu == DRAFT_KV_PER_TOKEN // tp
    draft_kv_mib = 4 * 8192 * DRAFT_KV_PER_TOKEN / tp / 2**20  # 4 sequences of 8,192 tokens
    assert with_draft.required_mib - base.required_mib == pytest.approx(DRAFT_WEIGHTS_MIB / tp + draft_kv_mib)
    assert with_draft.max_concurrency < base.max_concurrency
    lines = with_draft.explain()
    [weights] = [ln for ln in lines if "draft weights" in ln]
    assert f"{DRAFT_WEIGHTS_MIB / tp / 1024:.2f} GiB" in weights and "llama-3.2-1b-instruct" in weights
    assert any(f"draft KV per token   {DRAFT_KV_PER_TOKEN // tp:,} B" in ln for ln in lines)
    assert not any("draft" in ln for ln in base.explain())


def test_the_planner_refuses_a_gpu_the_draft_no_longer_fits(draft_dir: Path) -> None:
    model = Catalog.load().get("llama-3.1-8b")
    draft = draft_model(_spec(draft_dir))
    # A GPU just big enough for the target alone at 8,192 tokens: the draft tips it over.
    target = estimate(model, gpu_memory_mib=81920, max_model_len=8192)
    both = estimate(model, gpu_memory_mib=81920, max_model_len=8192, draft=draft)
    memory = int((target.required_mib + both.required_mib) / 2 / 0.9) + 1
    fleet = Fleet(nodes=[node("g1", "L40S", 1, memory)])
    alone = place(fleet, _spec(None, max_model_len=8192), model)
    assert len(alone.replicas) == 1 and not alone.unplaced
    with_draft = place(fleet, _spec(draft_dir, max_model_len=8192), model, explain=True)
    assert not with_draft.replicas and with_draft.unplaced == 1
