"""Model catalog and memory estimator: ``Catalog.load(extra).get(name) -> ModelSpec``, ``estimate(...)``."""

from controlplane.catalog._catalog import (
    Catalog,
    CatalogEntry,
    CatalogFile,
    draft_model,
    spec_from_hf_config,
)
from controlplane.catalog._checkpoint import CheckpointFormat, checkpoint_format
from controlplane.catalog._memory import (
    ACTIVATION_TOKENS,
    CUDA_GRAPH_MIB,
    KV_BLOCK_TOKENS,
    NCCL_MIB,
    NON_TORCH_MIB,
    MemoryEstimate,
    count_params,
    estimate,
    kv_bytes_per_token,
    lora_budget,
    lora_slots_mib,
    weight_bytes_per_param,
)

__all__ = [
    "ACTIVATION_TOKENS",
    "CUDA_GRAPH_MIB",
    "KV_BLOCK_TOKENS",
    "NCCL_MIB",
    "NON_TORCH_MIB",
    "Catalog",
    "CatalogEntry",
    "CatalogFile",
    "CheckpointFormat",
    "MemoryEstimate",
    "checkpoint_format",
    "count_params",
    "draft_model",
    "estimate",
    "kv_bytes_per_token",
    "lora_budget",
    "lora_slots_mib",
    "spec_from_hf_config",
    "weight_bytes_per_param",
]
