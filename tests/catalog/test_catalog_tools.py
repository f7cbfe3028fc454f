"""Tool calling in the catalog: each family's parser is one vLLM has; local models get their family's."""

from __future__ import annotations

import json
import subprocess
import sys

from controlplane.catalog import Catalog, spec_from_hf_config


def test_catalog_parsers_are_vllms_own() -> None:
    """The parser names are checked against the vLLM the tests run (the same version as the GPU image)."""
    catalog = Catalog.load()
    names = {n: catalog.get(n).tool_call_parser for n in catalog.names()}
    assert names["qwen2.5-7b"] == "hermes" and names["llama-3.1-8b"] == "llama3_json"
    assert names["llama-3-8b"] is None  # Llama 3.0 has no tool-call format
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from vllm.tool_parsers.abstract_tool_parser import ToolParserManager as T; "
            "import vllm.tool_parsers; print(json.dumps(sorted(set(T.tool_parsers) | set(T.lazy_parsers))))",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    known = set(json.loads(listed.stdout.strip().splitlines()[-1]))
    wanted = {p for p in names.values() if p}
    assert wanted and wanted <= known, wanted - known


def test_a_local_model_gets_its_familys_parser() -> None:
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 512,
        "vocab_size": 512,
    }
    assert spec_from_hf_config(cfg, name="q").tool_call_parser == "hermes"
    assert (
        spec_from_hf_config(cfg | {"architectures": ["GPT2LMHeadModel"]}, name="g").tool_call_parser is None
    )
