"""The simulator's pure parts: tokenizer, prefix cache bookkeeping, latency model, metrics text, CLI."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controlplane.errors import ConfigError
from controlplane.simulator import SimConfig, config_args, count_tokens, tokenize
from controlplane.simulator.cli import parse_config
from controlplane.simulator.engine import BatchEngine, PrefixCache, block_hashes
from controlplane.simulator.metrics import SimMetrics
from controlplane.simulator.tokens import generate_pieces


def test_tokenizer_is_deterministic_and_documented() -> None:
    assert tokenize("Hello world") == ["Hell", "o", " worl", "d"]
    assert count_tokens("") == 0
    assert count_tokens("a b c") == 3
    pieces = generate_pieces(3, 50)
    assert pieces == generate_pieces(3, 50)
    assert count_tokens("".join(pieces)) == 50


def test_block_hashes_chain() -> None:
    a = block_hashes(list(range(64)), 16, 63)
    assert len(a) == 3  # the last, partial block is never hashed
    b = block_hashes([*range(16), *range(100, 148)], 16, 63)
    assert a[0] == b[0]
    assert a[1:] != b[1:]
    # Same block content after a different prefix: a different hash.
    c = block_hashes([*range(100, 116), *range(16, 32)], 16, 32)
    assert c[1] != a[1]
    assert block_hashes(list(range(64)), 16, 63, salt="lora-a") != a


def test_prefix_cache_refcounts_and_lru() -> None:
    cache = PrefixCache(capacity_blocks=6)
    x, y = [1, 2, 3], [4, 5, 6]
    assert cache.fits(x, 4)
    cache.allocate(x, 4)
    assert cache.used_blocks == 4
    assert cache.fits(x, 4)  # a second request sharing x needs just one new block
    assert not cache.fits(y, 4)
    cache.release(x, 4)
    assert cache.used_blocks == 0
    assert cache.cached_blocks == 3
    assert cache.match(x) == 3
    cache.allocate(y, 4)  # 3 cached free + 4 new > 6: evicts the LRU blocks, tail of x first
    assert cache.evictions == 1
    assert cache.match(x) == 2
    assert cache.match(y) == 3


def test_latency_model_prefill_and_load() -> None:
    cfg = SimConfig(ttft_ms=30, prefill_ms_per_token=0.25, itl_ms=12, max_num_seqs=5, load_factor=3.0)
    engine = BatchEngine(cfg, SimMetrics("m", cfg.max_model_len, [], 0))
    slot = engine.prepare(list(range(400)), 10, 1, None, 0.0)
    engine._start(slot, 0.0)
    assert engine.ttft(slot) == pytest.approx(0.130)  # 30 ms + 400 × 0.25 ms, one running sequence
    assert engine.itl() == pytest.approx(0.012)
    engine.release(slot, 0.0)
    again = engine.prepare(list(range(400)), 10, 1, None, 0.0)
    engine._start(again, 0.0)
    assert again.cached_tokens == 384
    assert engine.ttft(again) == pytest.approx((30 + 16 * 0.25) / 1000)
    others = [engine.prepare([i], 1, 1, None, 0.0) for i in range(4)]
    for o in others:
        engine._start(o, 0.0)
    assert engine.itl() == pytest.approx(0.036)  # all 5 slots busy: load_factor 3


def test_metrics_text_parses_with_counters_and_buckets() -> None:
    m = SimMetrics("my-model", 4096, ["a"], 1, {"block_size": "16", "num_gpu_blocks": "8"})
    m.ttft.observe(0.03)
    m.itl.observe(0.012, 9)
    m.lora_running["a"] = 1
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    itl = {s.labels.get("le"): s.value for s in families["vllm:inter_token_latency_seconds"].samples}
    assert itl["0.01"] == 0
    assert itl["0.025"] == 9
    assert itl["+Inf"] == 9
    lora = families["vllm:lora_requests_info"].samples[0].labels
    assert lora["running_lora_adapters"] == "a"
    assert lora["max_lora"] == "1"
    assert families["vllm:prompt_tokens"].type == "counter"
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels == {"block_size": "16", "num_gpu_blocks": "8", "engine": "0"}
    assert info.value == 1
    tokens = [s.labels["le"] for s in families["vllm:request_prompt_tokens"].samples if "le" in s.labels]
    assert tokens[:4] == ["1.0", "2.0", "5.0", "10.0"]
    assert tokens[-2:] == ["2000.0", "+Inf"]


def test_cli_options_map_to_config_fields() -> None:
    cfg = parse_config(
        [
            "--served-model-name",
            "x",
            "--max-num-seqs",
            "3",
            "--no-enable-prefix-caching",
            "--lora-modules",
            "a",
            "b=/p",
        ]
    )
    assert cfg.served_model_name == "x"
    assert cfg.max_num_seqs == 3
    assert cfg.enable_prefix_caching is False
    assert cfg.model_names == ["x", "a", "b"]
    with pytest.raises(ConfigError, match="load_factor"):
        parse_config(["--load-factor", "0.5"])


def test_config_args_round_trip() -> None:
    cfg = SimConfig(
        served_model_name="llama",
        model="/models/llama",
        lora_modules=["a", "b=/p"],
        enable_prefix_caching=False,
        latency_mode="fixed",  # type: ignore[arg-type]
        task="embed",  # type: ignore[arg-type]
        load_factor=2.5,
        crash_after=3,
        api_key="secret",
    )
    args = config_args(cfg)
    assert "secret" not in args
    assert parse_config(args) == cfg.model_copy(update={"api_key": None})
    assert config_args(SimConfig()) == []
