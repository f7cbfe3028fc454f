"""Prompt measurement: exact with a tokenizer (token blocks), a lower bound and byte blocks without."""

from __future__ import annotations

import pytest

from controlplane.errors import ConfigError
from controlplane.gateway.tokens import TokenCounter, chain_hashes


@pytest.fixture
def tokenizer_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["the cat sat on the mat", "a dog"], trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def _counter(path=None, **kw):
    args = {"max_bytes_per_token": 8, "block_tokens": 2, "block_bytes": 8, "max_blocks": 256, **kw}
    return TokenCounter(tokenizer_path=path, **args)


def test_exact_count_and_token_blocks(tokenizer_file):
    c = _counter(tokenizer_file)
    info = c.measure(["the cat sat on the mat"], [])
    assert info.exact
    assert info.tokens == 6
    assert len(info.blocks) == 3  # 6 tokens in blocks of 2
    # the same leading blocks hash the same: that is what prefix affinity matches on
    other = c.measure(["the cat sat on a dog"], [])
    assert other.blocks[:2] == info.blocks[:2]
    assert other.blocks[2] != info.blocks[2]
    # chat: 4 tokens per message on top of the content
    assert c.measure(["the cat", "a dog"], [], messages=2).tokens == 4 + 8


def test_without_tokenizer_a_lower_bound_and_byte_blocks():
    c = _counter()
    info = c.measure(["x" * 80], [])
    assert not info.exact
    assert info.tokens == 10  # 80 bytes ÷ 8 bytes per token, rounded up
    assert len(info.blocks) == 10
    ids = c.measure([], [[1, 2, 3, 4, 5]])
    assert ids.exact
    assert ids.tokens == 5


def test_chain_hashes_cover_whole_blocks_only():
    assert chain_hashes(b"abcdefg", 4, 10) == chain_hashes(b"abcdXYZ", 4, 10)
    assert len(chain_hashes(b"a" * 100, 4, 5)) == 5


def test_unreadable_tokenizer_is_a_config_error(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot load tokenizer"):
        _counter(bad)


def test_gateway_counts_with_the_configured_tokenizer(tokenizer_file, tmp_path, sim_server, gateway_factory):
    import httpx
    from fixtures.gateway import add_key, add_replica, make_store

    from controlplane.gateway import GatewayConfig
    from controlplane.gateway.config import ModelOverrides

    sim = sim_server(served_model_name="m1")
    store = make_store(tmp_path)
    add_replica(store, sim.url, "m1", rid="m1-0")
    key = add_key(store, "t")
    cfg = GatewayConfig(models={"m1": ModelOverrides(tokenizer=tokenizer_file, max_context=16)})
    gw = gateway_factory(store, cfg)
    r = httpx.post(
        f"{gw.url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "m1", "prompt": "the cat sat on the mat " * 3},
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "the prompt is 18 tokens; the model 'm1' accepts at most 16"
