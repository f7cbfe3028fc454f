"""Exact prompt lengths without configuration: the gateway loads each served model's tokenizer (and chat
template) from the verified weights its replicas run, and falls back to the byte bound, saying so."""

from __future__ import annotations

import shutil
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


@pytest.mark.parametrize("chat", CHATS, ids=["one", "system", "turns"])
@pytest.mark.xfail(
    reason="open: importing transformers after ansible in one process fails in torch dynamo (ansible's sys.intern patch); compare in a subprocess",  # noqa: E501
    strict=False,
)
def test_a_chat_counts_as_transformers_renders_it_for_vllm(tiny: Path, chat: list[dict[str, str]]) -> None:
    from transformers import AutoTokenizer  # what vLLM's chat rendering uses

    want = AutoTokenizer.from_pretrained(str(tiny)).apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    texts, roles = [m["content"] for m in chat], [m["role"] for m in chat]
    info = _counter(tiny).measure(texts, [], len(chat), roles)
    assert info.exact and info.tokens == len(want)


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
