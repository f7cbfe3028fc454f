"""Exact prompt lengths without configuration: the gateway loads each served model's tokenizer (and chat
template) from the verified weights its replicas run, and falls back to the byte bound, saying so."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fixtures.gateway import GatewayStarter, add_key, add_replica, gateway_factory, make_store, wait_for
from fixtures.sim import SimFactory

from controlplane.errors import ConfigError
from controlplane.gateway.config import GatewayConfig, LimitsConfig
from controlplane.gateway.tokens import TokenCounter, verified_tokenizer
from controlplane.weights.tiny import generate_tiny_model

__all__ = ["gateway_factory"]  # the fixture, used by name

CHATS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a KV cache?"}],
    [
        {"role": "user", "content": "count: one two three"},
        {"role": "assistant", "content": "four five"},
        {"role": "user", "content": "ünïcödé and emoji 🙂 too"},
    ],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_tiny_model(tmp_path_factory.mktemp("w") / "sarv-tiny")


def _counter(weights: Path) -> TokenCounter:
    path, config = verified_tokenizer(weights)
    return TokenCounter(tokenizer_path=path, max_bytes_per_token=4, block_tokens=16, block_bytes=64,
                        max_blocks=8, tokenizer_config=config)  # fmt: skip


# transformers is run in its own interpreter: in a pytest process that has already imported ansible
# (other tests do), importing it fails inside torch's dynamo on ansible's patched sys.intern.
_RENDER = """
import json, sys
from transformers import AutoTokenizer  # what vLLM's chat rendering uses
tok = AutoTokenizer.from_pretrained(sys.argv[1])
chats = json.loads(sys.stdin.read())
print(json.dumps([len(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)) for c in chats]))
"""


@pytest.fixture(scope="module")
def transformers_lengths(tiny: Path) -> list[int]:
    proc = subprocess.run([sys.executable, "-c", _RENDER, str(tiny)], input=json.dumps(CHATS),
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lengths: list[int] = json.loads(proc.stdout)
    return lengths


@pytest.mark.parametrize("index", range(len(CHATS)), ids=["one", "system", "turns"])
def test_a_chat_counts_as_transformers_renders_it_for_vllm(
    tiny: Path, transformers_lengths: list[int], index: int
) -> None:
    chat = CHATS[index]
    texts, roles = [m["content"] for m in chat], [m["role"] for m in chat]
    info = _counter(tiny).measure(texts, [], len(chat), roles)
    assert info.exact
    assert info.tokens == transformers_lengths[index]


def test_a_tokenizer_that_differs_from_the_manifest_is_refused(tiny: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny, tmp_path / "copy"))
    (copy / "tokenizer.json").write_text(
        (copy / "tokenizer.json").read_text().replace('"<|eos|>"', '"<|x|>"')
    )
    with pytest.raises(ConfigError, match=r"tokenizer\.json does not match its manifest"):
        verified_tokenizer(copy)
    (copy / "SHA256SUMS").unlink()
    with pytest.raises(ConfigError, match="SHA256SUMS"):
        verified_tokenizer(copy)


def test_the_gateway_counts_exactly_from_the_replicas_weights(
    tiny: Path, tmp_path: Path, sim_server: SimFactory, gateway_factory: GatewayStarter
) -> None:
    cache = tmp_path / "cache"
    landed = Path(shutil.copytree(tiny, cache / "sarv-tiny" / "abc123"))
    sim = sim_server(served_model_name="tiny", max_model_len=64, kv_cache_tokens=4096)
    store = make_store(tmp_path)
    key = add_key(store)
    add_replica(store, sim.url, "tiny", rid="tiny-0", weights=f"sarv-tiny/{landed.name}")
    # 60 words of 2-4 letters: ~200 bytes is at least 50 tokens by the byte bound (4 B/token), under
    # the 64-token context, but the tiny tokenizer (bytes and few merges) makes it far more.
    prompt = " ".join(["ab", "cde", "fghi"] * 20)
    config = GatewayConfig(model_cache=cache, limits=LimitsConfig(max_bytes_per_token=4))
    gw = gateway_factory(store, config=config)
    exact = _counter(tiny).measure([prompt], [], 0).tokens
    assert exact > 64

    def refused_exactly() -> bool:
        r = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=10)  # fmt: skip
        return r.status_code == 400 and f"the prompt is {exact} tokens" in r.text

    wait_for(refused_exactly)  # the first requests may count by bytes while the tokenizer loads
    text = httpx.get(gw.metrics_url).text
    assert 'sarv_gateway_tokenizer_exact{model="tiny"} 1.0' in text


def test_weights_outside_the_cache_keep_the_byte_bound_and_say_so(
    tmp_path: Path, sim_server: SimFactory, gateway_factory: GatewayStarter
) -> None:
    sim = sim_server(served_model_name="tiny", max_model_len=64, kv_cache_tokens=4096)
    store = make_store(tmp_path)
    key = add_key(store)
    add_replica(store, sim.url, "tiny", rid="tiny-0", weights="sarv-tiny/not-here")
    gw = gateway_factory(store, config=GatewayConfig(model_cache=tmp_path / "cache"))
    prompt = "x" * 1000  # 1000 bytes: at least 250 tokens by the bound

    def refused_by_bound() -> bool:
        r = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 1}, timeout=10)  # fmt: skip
        return r.status_code == 400 and "the prompt is at least" in r.text

    wait_for(refused_by_bound)
    wait_for(lambda: 'sarv_gateway_tokenizer_exact{model="tiny"} 0.0' in httpx.get(gw.metrics_url).text)
