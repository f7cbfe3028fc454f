"""The built-in catalog, user catalog files and Hugging Face config.json directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.catalog import Catalog, count_params, kv_bytes_per_token
from controlplane.errors import ConfigError, UnknownModelError
from controlplane.spec import Quantization

REQUIRED = ["llama-3-8b", "llama-70b", "llama-3.1-405b", "mixtral-8x7b", "qwen2.5-72b", "sarv-tiny"]


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return Catalog.load()


def test_required_models_present(catalog: Catalog) -> None:
    assert set(REQUIRED) <= set(catalog.names())


@pytest.mark.parametrize("name", [*REQUIRED, "llama-3.1-8b", "qwen2.5-7b"])
def test_declared_params_match_architecture(catalog: Catalog, name: str) -> None:
    # Qwen's q/k/v biases are not in count_params: allow 0.01 %.
    m = catalog.get(name)
    assert count_params(m) == pytest.approx(m.num_params, rel=1e-4)


@pytest.mark.parametrize(
    ("name", "kv_bytes", "params_b"),
    [
        ("llama-3-8b", 131_072, 8.03),
        ("llama-70b", 327_680, 70.55),
        ("mixtral-8x7b", 131_072, 46.70),
        ("qwen2.5-72b", 327_680, 72.71),
    ],
)
def test_reference_numbers(catalog: Catalog, name: str, kv_bytes: int, params_b: float) -> None:
    m = catalog.get(name)
    assert kv_bytes_per_token(m) == kv_bytes
    assert round(m.num_params / 1e9, 2) == params_b


def test_llama_70b_is_llama_3_70b_instruct(catalog: Catalog) -> None:
    m = catalog.get("llama-3-70b")
    assert m.name == "llama-70b"
    assert m.hf_id == "meta-llama/Meta-Llama-3-70B-Instruct"
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads) == (80, 8192, 64, 8)
    assert (m.head_dim, m.intermediate_size, m.vocab_size, m.max_model_len) == (128, 28672, 128256, 8192)


def test_variants_and_moe(catalog: Catalog) -> None:
    mixtral = catalog.get("mixtral-8x7b")
    assert (mixtral.num_experts, mixtral.experts_per_token) == (8, 2)
    assert catalog.get("llama-70b").quantizations == [
        Quantization.NONE,
        Quantization.FP8,
        Quantization.INT8,
        Quantization.AWQ,
        Quantization.GPTQ,
    ]


def test_sarv_tiny_entry(catalog: Catalog) -> None:
    m = catalog.get("sarv-tiny")
    assert (m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.head_dim) == (256, 4, 2, 64)
    assert (m.num_layers, m.intermediate_size, m.vocab_size, m.max_model_len) == (2, 512, 512, 1024)


def test_unknown_model_names_close_matches(catalog: Catalog) -> None:
    with pytest.raises(UnknownModelError, match=r"did you mean llama-70b") as err:
        catalog.get("lama-70b")
    assert err.value.exit_code == 2


def test_unknown_model_without_close_match_lists_models(catalog: Catalog) -> None:
    with pytest.raises(UnknownModelError, match=r"known models: .*sarv-tiny"):
        catalog.get("zzzzzzzz")


def test_user_file_adds_and_overrides(tmp_path: Path) -> None:
    extra = tmp_path / "models.yaml"
    extra.write_text(
        """
version: 1
models:
  - name: my-model
    aliases: [mine]
    num_layers: 4
    hidden_size: 512
    num_attention_heads: 8
    num_kv_heads: 8
    head_dim: 64
    intermediate_size: 1024
    vocab_size: 1000
    num_params: 13000000
    max_model_len: 2048
    quantizations: [none]
  - name: llama-3-8b
    num_layers: 32
    hidden_size: 4096
    num_attention_heads: 32
    num_kv_heads: 8
    head_dim: 128
    intermediate_size: 14336
    vocab_size: 128256
    num_params: 8030261248
    max_model_len: 4096
"""
    )
    cat = Catalog.load([extra])
    assert cat.get("mine").num_layers == 4
    assert cat.get("llama-3-8b").max_model_len == 4096  # the user's entry wins


def test_bad_user_file_says_which_field(tmp_path: Path) -> None:
    extra = tmp_path / "bad.yaml"
    extra.write_text("models:\n  - name: broken\n    num_layers: 0\n")
    with pytest.raises(ConfigError, match=r"catalog file .*bad.yaml.*num_layers"):
        Catalog.load([extra])


def test_missing_source_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Catalog.load([tmp_path / "nope.yaml"])


def test_hf_config_dir(tmp_path: Path) -> None:
    d = tmp_path / "Meta-Llama-3-8B"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "vocab_size": 128256,
                "max_position_embeddings": 8192,
                "tie_word_embeddings": False,
                "quantization_config": {"quant_method": "awq", "bits": 4},
            }
        )
    )
    m = Catalog.load([d]).get("meta-llama-3-8b")
    assert m.head_dim == 128
    assert m.num_params == 8_030_261_248
    assert m.quantizations == [Quantization.AWQ]
    assert kv_bytes_per_token(m) == 131_072


def test_hf_config_missing_keys(tmp_path: Path) -> None:
    d = tmp_path / "broken"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ConfigError, match=r"config\.json lacks"):
        Catalog.load([d])


def test_generated_tiny_model_matches_its_entry(tmp_path: Path, catalog: Catalog) -> None:
    """The runtime's tiny model, read back from its config.json, has the sarv-tiny numbers, and its
    safetensors hold exactly the parameters the catalog counts."""
    from safetensors.numpy import load_file

    from controlplane.weights.tiny import generate_tiny_model

    d = generate_tiny_model(tmp_path / "sarv-tiny")
    from_dir = Catalog.load([d]).get("sarv-tiny")
    entry = catalog.get("sarv-tiny")
    for field in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim"):
        assert getattr(from_dir, field) == getattr(entry, field), field
    assert (from_dir.intermediate_size, from_dir.vocab_size) == (entry.intermediate_size, entry.vocab_size)
    tensors = load_file(str(d / "model.safetensors"))
    assert sum(t.size for t in tensors.values()) == from_dir.num_params == entry.num_params
