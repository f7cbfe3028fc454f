"""The model catalog: built-in ``models.yaml`` plus user files and local Hugging Face model directories."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controlplane.errors import ConfigError, UnknownModelError, describe_validation_error
from controlplane.spec import DeploymentSpec, ModelSpec, Quantization

__all__ = ["Catalog", "CatalogEntry", "CatalogFile", "draft_model", "spec_from_hf_config"]


class CatalogEntry(ModelSpec):
    """One catalog entry: a :class:`ModelSpec` plus the other names it answers to."""

    aliases: list[str] = Field(default_factory=list)

    def to_spec(self) -> ModelSpec:
        return ModelSpec.model_validate(self.model_dump(exclude={"aliases"}))


class CatalogFile(BaseModel):
    """The shape of ``models.yaml`` and of user catalog files."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(default=1, ge=1, le=1)
    models: list[CatalogEntry] = Field(default_factory=list)


_QUANT_METHODS = {
    "awq": Quantization.AWQ,
    "gptq": Quantization.GPTQ,
    "fp8": Quantization.FP8,
    "compressed-tensors": Quantization.INT8,
    "bitsandbytes": Quantization.INT8,
}


# The tool-call format of a model family, by architecture, for models read from a local config.json.
# Built-in catalog entries name theirs (models.yaml); Llama 3.0 checkpoints share the 3.1 architecture
# but have no tool format: give such a model its own catalog entry without tool_call_parser.
TOOL_CALL_PARSERS = {
    "LlamaForCausalLM": "llama3_json",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "hermes",
    "Qwen2MoeForCausalLM": "hermes",
    "Qwen3ForCausalLM": "hermes",
    "Qwen3MoeForCausalLM": "hermes",
}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.-]+", "-", text.lower()).strip("-.") or "model"


def spec_from_hf_config(config: dict[str, Any], *, name: str) -> CatalogEntry:
    """A catalog entry from a Hugging Face ``config.json`` (llama, mistral, mixtral, qwen2 style keys)."""
    from controlplane.catalog._memory import count_params

    text = config.get("text_config")
    cfg: dict[str, Any] = {**config, **text} if isinstance(text, dict) else config
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        intermediate = int(cfg.get("intermediate_size") or cfg["moe_intermediate_size"])
        vocab = int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"model {name}: config.json lacks {exc} (need hidden_size, num_attention_heads, "
            "num_hidden_layers, intermediate_size, vocab_size)"
        ) from None
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 1)
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    quant = cfg.get("quantization_config")
    variants = [Quantization.NONE, Quantization.FP8, Quantization.INT8, Quantization.AWQ, Quantization.GPTQ]
    if isinstance(quant, dict):
        method = str(quant.get("quant_method", "")).lower()
        variants = [_QUANT_METHODS.get(method, Quantization.INT8)]
    fields: dict[str, Any] = {
        "name": name,
        "architecture": str(archs[0]),
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "intermediate_size": intermediate,
        "num_experts": experts,
        "experts_per_token": int(cfg.get("num_experts_per_tok") or 1) if experts > 1 else 1,
        "vocab_size": vocab,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "max_model_len": int(cfg.get("max_position_embeddings") or 4096),
        "quantizations": variants,
        "num_params": 1,
        "tool_call_parser": TOOL_CALL_PARSERS.get(str(archs[0])),
    }
    try:
        entry = CatalogEntry.model_validate(fields)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, what=f"model {name} (config.json)")) from None
    entry.num_params = count_params(entry)
    return entry


def draft_model(spec: DeploymentSpec) -> ModelSpec | None:
    """The speculative draft model's shape, from its source's config.json; None without a draft model.

    The planner counts the draft's weights and KV cache, so a draft whose shape cannot be read is an
    error here, before anything is placed.
    """
    speculative = spec.speculative
    if speculative is None or speculative.model is None:
        return None
    return _draft_from_source(speculative.model)


@lru_cache(maxsize=32)
def _draft_from_source(source: str) -> ModelSpec:
    from controlplane.errors import WeightsError
    from controlplane.weights import read_source_json

    config = read_source_json(source)
    if config is None:
        raise WeightsError(
            f"draft model {source!r} has no config.json",
            hint="give the draft model's directory (with config.json and a SHA256SUMS manifest); "
            "the planner needs its shape to count its memory",
        )
    name = _slug(source.rstrip("/").rsplit("/", 1)[-1])
    return spec_from_hf_config(config, name=name).to_spec()


def _read_yaml(path: Path) -> list[CatalogEntry]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read catalog file {path}: {exc}") from None
    try:
        return CatalogFile.model_validate(data or {}).models
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, what=f"catalog file {path}")) from None


def _read_hf_dir(path: Path) -> list[CatalogEntry]:
    config_path = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read Hugging Face config {config_path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path} is not a JSON object; expected a Hugging Face config.json")
    return [spec_from_hf_config(config, name=_slug(config_path.parent.name))]


class Catalog:
    """Models by name and alias. Later sources override earlier ones with the same name."""

    def __init__(self, entries: Iterable[CatalogEntry]) -> None:
        self._entries: dict[str, CatalogEntry] = {}
        self._aliases: dict[str, str] = {}
        for entry in entries:
            self._entries[entry.name] = entry
        for entry in self._entries.values():
            for alias in entry.aliases:
                self._aliases.setdefault(alias, entry.name)

    @classmethod
    def load(cls, extra: Sequence[Path] = ()) -> Catalog:
        """The built-in catalog plus ``extra`` YAML files, model directories or ``config.json`` files."""
        text = resources.files("controlplane.catalog").joinpath("models.yaml").read_text(encoding="utf-8")
        entries = CatalogFile.model_validate(yaml.safe_load(text)).models
        for path in extra:
            if not path.exists():
                raise ConfigError(
                    f"catalog source {path} does not exist; give a YAML file or a model directory"
                )
            if path.is_dir() or path.suffix == ".json":
                entries += _read_hf_dir(path)
            else:
                entries += _read_yaml(path)
        return cls(entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entry(self, name: str) -> CatalogEntry:
        key = name.strip().lower()
        canonical = key if key in self._entries else self._aliases.get(key)
        if canonical is None:
            known = sorted([*self._entries, *self._aliases])
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
            hint = (
                f"did you mean {', '.join(close)}?" if close else f"known models: {', '.join(self.names())}"
            )
            raise UnknownModelError(
                f"model {name!r} is not in the catalog; {hint} "
                "(add one with --catalog FILE.yaml or a local model directory)"
            )
        return self._entries[canonical]

    def get(self, name: str) -> ModelSpec:
        """The model's spec by name or alias; :class:`UnknownModelError` names close matches."""
        return self.entry(name).to_spec()
