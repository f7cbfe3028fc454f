"""What a checkpoint's ``config.json`` says about its weights: the variant and vLLM's method for it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from controlplane.spec import Quantization

__all__ = ["CheckpointFormat", "checkpoint_format"]

# quant_method values of Hugging Face configs, as vLLM names them, and the variant each one is.
_METHODS = {
    "fp8": Quantization.FP8,
    "fbgemm_fp8": Quantization.FP8,
    "awq": Quantization.AWQ,
    "gptq": Quantization.GPTQ,
}


class CheckpointFormat(BaseModel):
    """The weight variant a checkpoint holds, vLLM's ``--quantization`` for it, and its stored dtype."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quantization: Quantization | None
    """None: a quantization method Sarv has no variant for."""
    method: str | None
    """``quantization_config.quant_method`` (None for unquantized weights)."""
    torch_dtype: str | None

    def describe(self) -> str:
        method = self.method or "none"
        return f"quant_method {method}, torch_dtype {self.torch_dtype or 'unset'}"


def _compressed_tensors(quant: dict[str, Any]) -> Quantization | None:
    """The variant of a compressed-tensors config: fp8 (float 8-bit), int8 (int 8-bit), gptq (int 4-bit)."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict):
        return None
    kinds = set()
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict):
            kinds.add((str(weights.get("type", "int")), int(weights.get("num_bits", 0))))
    if kinds == {("float", 8)}:
        return Quantization.FP8
    if kinds == {("int", 8)}:
        return Quantization.INT8
    if kinds == {("int", 4)}:
        return Quantization.GPTQ
    return None


def checkpoint_format(config: dict[str, Any]) -> CheckpointFormat:
    """Read ``quantization_config`` and ``torch_dtype`` (or ``dtype``) of a Hugging Face ``config.json``."""
    text = config.get("text_config")
    cfg = {**config, **text} if isinstance(text, dict) else config
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    quant = cfg.get("quantization_config")
    if not isinstance(quant, dict):
        return CheckpointFormat(quantization=Quantization.NONE, method=None, torch_dtype=dtype)
    method = str(quant.get("quant_method", "")).lower() or None
    variant = _compressed_tensors(quant) if method == "compressed-tensors" else _METHODS.get(method or "")
    return CheckpointFormat(quantization=variant, method=method, torch_dtype=dtype)
