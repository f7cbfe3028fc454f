"""The tiny model is generated offline, byte-for-byte reproducibly, with the catalog's architecture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from controlplane.catalog import Catalog
from controlplane.weights import MANIFEST_NAME, verify_dir
from controlplane.weights.tiny import TINY_MODEL_NAME, generate_tiny_model


def test_generation_is_deterministic(tmp_path: Path) -> None:
    a = generate_tiny_model(tmp_path / "a")
    b = generate_tiny_model(tmp_path / "b")
    assert (a / MANIFEST_NAME).read_text() == (b / MANIFEST_NAME).read_text()
    verify_dir(a)


def test_architecture_matches_the_catalog_entry(tmp_path: Path) -> None:
    model = generate_tiny_model(tmp_path / "t")
    cfg = json.loads((model / "config.json").read_text())
    spec = Catalog.load().get(TINY_MODEL_NAME)
    assert cfg["architectures"] == [spec.architecture]
    assert cfg["hidden_size"] == spec.hidden_size
    assert cfg["num_attention_heads"] == spec.num_attention_heads
    assert cfg["num_key_value_heads"] == spec.num_kv_heads
    assert cfg["head_dim"] == spec.head_dim == 64  # vLLM's CPU attention refuses head_dim 16
    assert cfg["num_hidden_layers"] == spec.num_layers
    assert cfg["intermediate_size"] == spec.intermediate_size
    assert cfg["vocab_size"] == spec.vocab_size
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), framework="numpy") as f:
        total = sum(int(f.get_tensor(k).size) for k in f.keys())  # noqa: SIM118 - safe_open is not a dict
    assert total == spec.num_params


def test_tokenizer_and_chat_template(tmp_path: Path) -> None:
    model = generate_tiny_model(tmp_path / "t")
    # transformers runs in a fresh interpreter, as vLLM loads the tokenizer: in this process other
    # tests have imported ansible-core, whose sys.intern patch breaks torch's import-time polyfills.
    check = """
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=True)
text = "Hello, Sarv! \u00fcn\u00efcode"
prompt = tok.apply_chat_template(
    [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
)
print(json.dumps({"roundtrip": tok.decode(tok.encode(text, add_special_tokens=False)) == text,
                  "prompt": prompt}))
"""
    out = subprocess.run(
        [sys.executable, "-c", check, str(model)], capture_output=True, text=True, check=True, timeout=300
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["roundtrip"] is True
    assert result["prompt"] == "<|bos|><|user|>hi<|end|><|assistant|>"
