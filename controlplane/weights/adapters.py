"""LoRA adapters and speculative draft models as sources: checked before anything is copied or started.

An adapter is a directory (or http(s)/s3 URL) holding ``adapter_config.json``, its safetensors weights and
a ``SHA256SUMS`` manifest, like a model's weights. A draft model is a model source of its own. These checks
run on the controller before a deploy records or copies anything, so a missing or unverifiable source is
refused with its name; the copy itself goes through :func:`controlplane.weights.ensure_weights`.
"""

from __future__ import annotations

import json
from pathlib import Path

from controlplane.errors import WeightsError
from controlplane.weights import read_manifest, verify_dir

__all__ = ["DEFAULT_MAX_LORA_RANK", "adapter_rank", "check_adapter_source", "check_draft_source"]

DEFAULT_MAX_LORA_RANK = 16
"""vLLM's default ``--max-lora-rank`` (``LoRAConfig.max_lora_rank``)."""

_ADAPTER_CONFIG = "adapter_config.json"


def _remote(source: str) -> bool:
    return source.startswith(("http://", "https://", "s3://"))


def _local_dir(source: str, what: str) -> Path:
    path = Path(source).expanduser()
    if not path.is_dir():
        raise WeightsError(
            f"{what}: {path} is not a directory",
            hint="give a directory holding the files and their SHA256SUMS manifest",
        )
    return path


def adapter_rank(directory: Path, name: str) -> int:
    """``r`` of the adapter's ``adapter_config.json`` (the PEFT format vLLM reads)."""
    cfg = directory / _ADAPTER_CONFIG
    try:
        data = json.loads(cfg.read_text())
    except FileNotFoundError:
        raise WeightsError(f"LoRA adapter {name!r}: {cfg} is missing") from None
    except (OSError, ValueError) as exc:
        raise WeightsError(f"LoRA adapter {name!r}: {cfg} is not valid JSON: {exc}") from None
    rank = data.get("r") if isinstance(data, dict) else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise WeightsError(f"LoRA adapter {name!r}: {cfg} has no positive integer rank 'r'")
    return rank


def check_adapter_source(name: str, source: str, *, max_lora_rank: int = DEFAULT_MAX_LORA_RANK) -> int | None:
    """Refuse an adapter that is missing, unverifiable or of a rank above ``max_lora_rank``.

    A local directory is hashed against its manifest here; a URL is checked where it lands (its rank is
    read then, so None is returned for it). Returns the adapter's rank when known.
    """
    what = f"LoRA adapter {name!r}"
    if _remote(source):
        return None
    directory = _local_dir(source, what)
    try:
        entries = read_manifest(directory)
        verify_dir(directory, entries)
    except WeightsError as exc:
        raise WeightsError(f"{what}: {exc.message}", hint=exc.hint) from None
    if _ADAPTER_CONFIG not in entries:
        raise WeightsError(f"{what}: its manifest does not list {_ADAPTER_CONFIG}")
    if not any(n.endswith(".safetensors") for n in entries):
        raise WeightsError(f"{what}: its manifest lists no .safetensors weights")
    rank = adapter_rank(directory, name)
    if rank > max_lora_rank:
        raise WeightsError(
            f"{what} has rank {rank}, above max_lora_rank {max_lora_rank}",
            hint=f"deploy with --engine-arg max_lora_rank={_next_rank(rank)}",
        )
    return rank


def check_draft_source(source: str) -> None:
    """Refuse a draft model directory that is missing or does not match its manifest."""
    what = f"draft model {source!r}"
    if _remote(source):
        return
    directory = _local_dir(source, what)
    try:
        verify_dir(directory, read_manifest(directory))
    except WeightsError as exc:
        raise WeightsError(f"{what}: {exc.message}", hint=exc.hint) from None


def _next_rank(rank: int) -> int:
    """The smallest rank vLLM accepts (its ``MaxLoRARanks``) that holds ``rank``."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if allowed >= rank:
            return allowed
    return rank
