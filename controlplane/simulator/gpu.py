"""Start-up checks of a simulator standing in for a GPU engine, refused the way vLLM refuses them.

They apply when the process is given GPUs (``CUDA_VISIBLE_DEVICES``), as a ``sim`` replica placed on a
GPU fleet is: the visible GPUs against tp × pp (the pipeline stages of this node), the planned per-GPU
memory against the fake GPU's memory, and the requested variant against the weights' ``config.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from controlplane.simulator.config import SimConfig

__all__ = ["GpuCheckError", "check_gpu_stand_in"]

# int8 checkpoints carry their scheme in quantization_config; vLLM reads it from there.
_INT8_METHODS = frozenset({"compressed-tensors", "bitsandbytes"})


class GpuCheckError(Exception):
    """A check failed; ``cause`` is the exception vLLM raises in the same situation."""

    def __init__(self, cause: Exception) -> None:
        self.cause = cause
        super().__init__(str(cause))


def _visible(environ: Mapping[str, str]) -> list[str] | None:
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d for d in (p.strip() for p in value.split(",")) if d]


def check_gpu_stand_in(config: SimConfig, environ: Mapping[str, str]) -> None:
    """Raise :class:`GpuCheckError` when a vLLM given the same GPUs, plan and weights would not start."""
    visible = _visible(environ)
    if visible is not None:
        stages = config.local_pipeline_stages or config.pipeline_parallel_size
        need = config.tensor_parallel_size * stages
        if len(visible) < need:
            where = "" if stages == config.pipeline_parallel_size else f" ({stages} pipeline stages here)"
            raise GpuCheckError(
                ValueError(
                    f"World size on this node ({config.tensor_parallel_size} tensor parallel × {stages} "
                    f"pipeline{where} = {need}) is larger than the number of available GPUs "
                    f"({len(visible)}, CUDA_VISIBLE_DEVICES={','.join(visible) or '<empty>'})"
                )
            )
        if config.gpu_memory_mib is not None and config.planned_gpu_memory_mib is not None:
            budget = int(config.gpu_memory_mib * config.gpu_memory_utilization)
            if config.planned_gpu_memory_mib > budget:
                raise GpuCheckError(
                    ValueError(
                        f"Free memory on device ({config.gpu_memory_mib} MiB total) is less than the "
                        f"planned {config.planned_gpu_memory_mib} MiB per GPU at gpu_memory_utilization "
                        f"{config.gpu_memory_utilization} ({budget} MiB). Decrease the plan's memory or "
                        "use a GPU with more memory."
                    )
                )
    if config.model is not None:
        _check_variant(config, Path(config.model) / "config.json")


def _check_variant(config: SimConfig, path: Path) -> None:
    if not path.is_file():
        return
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GpuCheckError(ValueError(f"{path}: not a readable config.json ({exc})")) from None
    qc = hf.get("quantization_config")
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else None
    wanted = (config.quantization or "").lower() or None
    if wanted in (None, "none"):
        if method is not None:
            raise GpuCheckError(
                ValueError(
                    f"The weights in {path.parent} are quantized ({method}) but no quantization was "
                    "requested: deploy the unquantized variant's weights or request --quantization "
                    f"{method}"
                )
            )
    elif wanted == "int8":
        if method not in _INT8_METHODS:
            raise GpuCheckError(
                ValueError(
                    f"Quantization method specified in the model config ({method or 'none'}) does not "
                    "match the quantization method specified in the `quantization` argument (int8)"
                )
            )
    elif method != wanted:
        raise GpuCheckError(
            ValueError(
                f"Quantization method specified in the model config ({method or 'none'}) does not match "
                f"the quantization method specified in the `quantization` argument ({wanted})"
            )
        )
    # vLLM casts an unquantized checkpoint to the requested dtype (vllm/config/model.py: upcasting to
    # float32 and downcasting from it are logged at info level, bfloat16 <-> float16 as a warning): it
    # refuses no dtype of the weights, so neither does the stand-in.
