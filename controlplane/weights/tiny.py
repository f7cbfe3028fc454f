"""A deterministic generator for ``sarv-tiny``: a small llama model vLLM's CPU build can serve offline."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from controlplane.errors import WeightsError

__all__ = ["TINY_MODEL_NAME", "TinyModelConfig", "generate_tiny_model"]

TINY_MODEL_NAME = "sarv-tiny"

# Special tokens come first so their ids are stable (0, 1, 2 …) whatever the BPE merges learn.
_SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# A ChatML-like template with the model's own special tokens; vLLM's chat endpoint needs one.
_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# Fixed training text: the tokenizer is a pure function of this corpus and the trainer settings.
_CORPUS = [
    "Sarv serves large language models on your own GPU servers, without Kubernetes, and works offline.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Hello! How are you today? I am fine, thank you. What can I do for you?",
    "def main():\n    print('hello, world')\n    return 0\n",
    "Tensor parallelism splits each layer across GPUs; pipeline parallelism splits the layers.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096",
    "The gateway routes each request to the replica with the best prefix match and the lowest load.",
    "user: tell me a story. assistant: once upon a time there was a tiny model that answered quickly.",
]


class TinyModelConfig(BaseModel):
    """Architecture of the tiny model. head_dim must stay 64: vLLM's CPU attention refuses 16."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(default=256, gt=0)
    num_attention_heads: int = Field(default=4, gt=0)
    num_kv_heads: int = Field(default=2, gt=0)
    num_layers: int = Field(default=2, gt=0)
    intermediate_size: int = Field(default=512, gt=0)
    vocab_size: int = Field(default=512, ge=320)
    """At least the 256 byte symbols plus the special tokens and some merges."""
    max_position_embeddings: int = Field(default=2048, gt=0)
    seed: int = 20240601

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def _weights(cfg: TinyModelConfig, vocab: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(cfg.seed)
    hd, h, kv = cfg.head_dim, cfg.hidden_size, cfg.num_kv_heads

    def normal(*shape: int) -> Any:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    tensors: dict[str, Any] = {"model.embed_tokens.weight": normal(vocab, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(cfg.num_attention_heads * hd, h)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv * hd, h)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv * hd, h)
        tensors[p + "self_attn.o_proj.weight"] = normal(h, cfg.num_attention_heads * hd)
        tensors[p + "mlp.gate_proj.weight"] = normal(cfg.intermediate_size, h)
        tensors[p + "mlp.up_proj.weight"] = normal(cfg.intermediate_size, h)
        tensors[p + "mlp.down_proj.weight"] = normal(h, cfg.intermediate_size)
        tensors[p + "input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    tensors["lm_head.weight"] = normal(vocab, h)
    return tensors


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def generate_tiny_model(dest: Path, config: TinyModelConfig | None = None) -> Path:
    """Write the tiny model (config, tokenizer, safetensors weights, ``SHA256SUMS``) to ``dest``.

    The output is byte-for-byte the same on every run and machine (fixed seed, fixed corpus), so its
    manifest can be pinned. ``dest`` is replaced atomically; an existing directory is left untouched
    when generation fails.
    """
    from safetensors.numpy import save_file

    from controlplane.weights import write_manifest

    cfg = config or TinyModelConfig()
    if cfg.hidden_size % cfg.num_attention_heads or cfg.num_attention_heads % cfg.num_kv_heads:
        raise WeightsError(
            f"tiny model: hidden_size {cfg.hidden_size}, heads {cfg.num_attention_heads} and kv heads "
            f"{cfg.num_kv_heads} must divide evenly"
        )
    dest = dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tok = _train_tokenizer(cfg.vocab_size)
        vocab = int(tok.get_vocab_size())
        tok.save(str(work / "tokenizer.json"))
        ids = {t: int(tok.token_to_id(t)) for t in _SPECIAL_TOKENS}
        _write_json(
            work / "config.json",
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "hidden_act": "silu",
                "max_position_embeddings": cfg.max_position_embeddings,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "vocab_size": vocab,
                "bos_token_id": ids["<|bos|>"],
                "eos_token_id": ids["<|eos|>"],
                "pad_token_id": ids["<|pad|>"],
                "torch_dtype": "float32",
            },
        )
        _write_json(
            work / "generation_config.json",
            {"bos_token_id": ids["<|bos|>"], "eos_token_id": [ids["<|eos|>"], ids["<|end|>"]]},
        )
        _write_json(
            work / "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "add_bos_token": False,
                "model_max_length": cfg.max_position_embeddings,
                "chat_template": _CHAT_TEMPLATE,
            },
        )
        _write_json(
            work / "special_tokens_map.json",
            {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"},
        )
        save_file(_weights(cfg, vocab), str(work / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(work / "model.safetensors", 0o644)  # safetensors writes 0600; weights are not secret
        write_manifest(work)
        os.chmod(work, 0o755)  # noqa: S103 - mkdtemp makes 0700; engines may run as another user
        if dest.exists():
            shutil.rmtree(dest)
        work.rename(dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dest
