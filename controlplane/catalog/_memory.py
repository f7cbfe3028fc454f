"""Per-GPU memory estimate of one replica split tp × pp: weights + overhead + KV cache against the budget."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from controlplane.errors import UserError
from controlplane.spec import DTYPE_BYTES, DeploymentSpec, Dtype, ModelSpec, Quantization

__all__ = [
    "ACTIVATION_TOKENS",
    "CUDA_GRAPH_MIB",
    "KV_BLOCK_TOKENS",
    "NCCL_MIB",
    "NON_TORCH_MIB",
    "MemoryEstimate",
    "count_params",
    "estimate",
    "kv_bytes_per_token",
    "lora_budget",
    "lora_slots_mib",
    "weight_bytes_per_param",
]

MIB = 1 << 20

KV_BLOCK_TOKENS = 16
"""vLLM allocates KV cache in blocks of 16 tokens, so a sequence occupies whole blocks."""
ACTIVATION_TOKENS = 8192
"""Tokens of vLLM's profiling forward pass (its default ``max_num_batched_tokens`` for the API server)."""
NON_TORCH_MIB = 256.0
"""CUDA context, cuBLAS workspace and allocator slack that vLLM reports as non-torch memory."""
NCCL_MIB = 512.0
"""NCCL and custom all-reduce buffers, only when a replica spans more than one GPU."""
CUDA_GRAPH_MIB = 512.0
"""CUDA graphs captured after profiling (vLLM logs ~0.3-0.6 GiB); taken from the same budget."""

# Activation peak of the profiling pass, in elements per token: the MLP's gate/up output and its
# activation (≈ 4 × intermediate per GPU) plus residual, attention and norm buffers (≈ 6 × hidden).
# Calibrated on vLLM's log for Llama-3-8B (activation peak ≈ 1.22 GiB at 8,192 tokens).
_ACT_PER_INTERMEDIATE = 4
_ACT_PER_HIDDEN = 6

# 4-bit AWQ/GPTQ store an fp16 scale and a 4-bit zero point per group of 128 weights.
_INT4_BYTES = 0.5 + 2.5 / 128


def weight_bytes_per_param(quantization: Quantization, dtype: Dtype) -> float:
    """Bytes per weight of the quantized (linear) layers; embeddings and norms keep ``dtype``."""
    if quantization is Quantization.AUTO:
        raise UserError(
            "quantization 'auto' has no size of its own; pick a variant (none, fp8, int8, awq, gptq)"
        )
    if quantization is Quantization.NONE:
        return DTYPE_BYTES[dtype]
    if quantization in (Quantization.FP8, Quantization.INT8):
        return 1.0
    return _INT4_BYTES


def _kv_dtype_bytes(kv_cache_dtype: str, dtype: Dtype) -> float:
    if kv_cache_dtype == "auto":
        return DTYPE_BYTES[dtype]
    if kv_cache_dtype.startswith("fp8"):
        return 1.0
    if kv_cache_dtype in ("bfloat16", "float16", "half"):
        return 2.0
    if kv_cache_dtype == "float32":
        return 4.0
    raise UserError(
        f"unknown kv_cache_dtype {kv_cache_dtype!r}; use auto, fp8, fp8_e4m3, fp8_e5m2 or bfloat16"
    )


def kv_bytes_per_token(
    model: ModelSpec, *, dtype: Dtype = Dtype.BF16, kv_cache_dtype: str = "auto", tp: int = 1, pp: int = 1
) -> int:
    """KV cache bytes one token occupies on one GPU of a tp × pp replica (tp = pp = 1: the whole model).

    2 (K and V) × layers × kv_heads × head_dim × bytes. TP splits the KV heads, and replicates them when
    tp > kv_heads (each GPU keeps at least one); PP splits the layers (the largest stage counts).
    """
    layers = math.ceil(model.num_layers / pp)
    kv_heads = max(1, model.num_kv_heads // tp)
    return int(2 * layers * kv_heads * model.head_dim * _kv_dtype_bytes(kv_cache_dtype, dtype))


def count_params(model: ModelSpec) -> int:
    """Parameters implied by the architecture numbers (llama-style blocks, all experts counted)."""
    h, i = model.hidden_size, model.intermediate_size
    attn = h * model.num_attention_heads * model.head_dim * 2 + h * model.num_kv_heads * model.head_dim * 2
    mlp = 3 * h * i * model.num_experts + (h * model.num_experts if model.num_experts > 1 else 0)
    per_layer = attn + mlp + 2 * h
    embeddings = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    return model.num_layers * per_layer + embeddings + h


def lora_slots_mib(
    model: ModelSpec,
    *,
    max_loras: int,
    max_lora_rank: int,
    tp: int = 1,
    pp: int = 1,
    dtype: Dtype = Dtype.BF16,
) -> float:
    """GPU memory vLLM reserves for LoRA on one GPU: ``max_loras`` slots of rank ``max_lora_rank``.

    vLLM (0.32, ``vllm/lora/layers``) wraps every linear layer of each decoder block and allocates, per
    layer, ``lora_a`` (max_loras × rank × input) and ``lora_b`` (max_loras × output × rank) per slice in
    the model dtype, whatever the adapters target: a column-parallel layer (merged qkv: 3 slices, gate_up: 2)
    keeps ``lora_a`` whole and splits ``lora_b`` by tp; a row-parallel one (o_proj, down_proj) splits
    ``lora_a`` and keeps ``lora_b`` whole. Adapter weights themselves stay in host memory
    (``max_cpu_loras`` of them) and are copied into these slots.
    """
    h, i, r = model.hidden_size, model.intermediate_size, max_lora_rank
    q_out = model.num_attention_heads * model.head_dim
    kv_out = model.num_kv_heads * model.head_dim
    qkv = 3 * r * h + r * (q_out + 2 * kv_out) / tp
    o_proj = r * q_out / tp + r * h
    gate_up = 2 * r * h + r * 2 * i / tp
    down = r * i / tp + r * h
    per_layer = (qkv + o_proj + gate_up + down) * max_loras * DTYPE_BYTES[dtype]
    return math.ceil(model.num_layers / pp) * per_layer / MIB


def lora_budget(spec: DeploymentSpec) -> dict[str, int]:
    """vLLM's LoRA slots for a deployment with LoRA on: ``max_loras`` (default 1) × ``max_lora_rank`` (16)."""
    args = spec.engine_args
    if not spec.lora_adapters and args.get("enable_lora") is not True:
        return {}
    loras, rank = args.get("max_loras", 1), args.get("max_lora_rank", 16)
    return {
        "max_loras": loras if isinstance(loras, int) and not isinstance(loras, bool) else 1,
        "max_lora_rank": rank if isinstance(rank, int) and not isinstance(rank, bool) else 16,
    }


class MemoryEstimate(BaseModel):
    """What one GPU of a replica needs, in MiB, and how many max_model_len sequences its KV cache holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    gpu_model: str
    gpu_memory_mib: int = Field(gt=0)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    quantization: Quantization
    max_model_len: int = Field(ge=1)
    concurrency: int = Field(ge=1)
    """Target number of max_model_len sequences held at once."""
    gpu_memory_utilization: float
    activation_tokens: int = ACTIVATION_TOKENS
    """Tokens of the profiling pass (``max_num_batched_tokens``)."""
    weights_mib: float
    """This GPU's share of the weights (largest pipeline stage, split by tp)."""
    activation_mib: float
    cuda_graph_mib: float
    non_torch_mib: float
    kv_bytes_per_token: int
    """Whole model, one token."""
    kv_bytes_per_token_per_gpu: int
    kv_per_sequence_mib: float
    """One max_model_len sequence on this GPU, rounded up to whole 16-token blocks."""
    lora_mib: float = 0.0
    """LoRA slots (``lora_slots_mib``); 0 without LoRA."""
    max_loras: int = 0
    max_lora_rank: int = 0
    draft_model: str = ""
    """Speculative draft model sharing the GPUs; empty without one (n-gram speculation needs none)."""
    draft_weights_mib: float = 0.0
    """This GPU's share of the draft's weights (the whole draft, split by the same tp)."""
    draft_kv_bytes_per_token_per_gpu: int = 0
    """The draft's KV cache per token on this GPU; included in ``kv_per_sequence_mib``."""

    @property
    def budget_mib(self) -> float:
        """What vLLM may use: gpu_memory_utilization × total memory."""
        return self.gpu_memory_utilization * self.gpu_memory_mib

    @property
    def overhead_mib(self) -> float:
        return self.activation_mib + self.cuda_graph_mib + self.non_torch_mib + self.lora_mib

    @property
    def kv_budget_mib(self) -> float:
        return self.budget_mib - self.weights_mib - self.draft_weights_mib - self.overhead_mib

    @property
    def max_concurrency(self) -> int:
        """Max_model_len sequences the KV cache holds at once (0: not even one fits)."""
        if self.kv_budget_mib <= 0:
            return 0
        return int(self.kv_budget_mib // self.kv_per_sequence_mib)

    @property
    def required_mib(self) -> float:
        """Weights + overhead + KV for ``concurrency`` sequences: the hard fit compares this to the budget."""
        return (
            self.weights_mib
            + self.draft_weights_mib
            + self.overhead_mib
            + self.concurrency * self.kv_per_sequence_mib
        )

    @property
    def fits(self) -> bool:
        return self.required_mib <= self.budget_mib

    def explain(self) -> list[str]:
        """The arithmetic, one line per step, for ``llmctl plan --explain``."""
        kv_tok = self.kv_bytes_per_token
        return [
            f"{self.model} tp={self.tp} pp={self.pp} quantization={self.quantization.value} on "
            f"{self.gpu_model} ({self.gpu_memory_mib / 1024:.1f} GiB):",
            f"  weights per GPU      {self.weights_mib / 1024:8.2f} GiB  "
            f"(largest stage of {self.pp}, split by tp={self.tp})",
            f"  activation peak      {self.activation_mib / 1024:8.2f} GiB  "
            f"(profiling pass of {self.activation_tokens} tokens)",
            f"  CUDA graphs          {self.cuda_graph_mib / 1024:8.2f} GiB",
            f"  non-torch / NCCL     {self.non_torch_mib / 1024:8.2f} GiB",
            *(
                [
                    f"  LoRA slots           {self.lora_mib / 1024:8.2f} GiB  "
                    f"(max_loras {self.max_loras} × max_lora_rank {self.max_lora_rank} on every linear layer)"
                ]
                if self.lora_mib
                else []
            ),
            *(
                [
                    f"  draft weights        {self.draft_weights_mib / 1024:8.2f} GiB  "
                    f"(speculative draft {self.draft_model}, split by tp={self.tp})"
                ]
                if self.draft_model
                else []
            ),
            f"  KV bytes per token   {kv_tok:,} B = 2 × layers × kv_heads × head_dim × bytes (whole model); "
            f"{self.kv_bytes_per_token_per_gpu:,} B on this GPU",
            *(
                [
                    f"  draft KV per token   {self.draft_kv_bytes_per_token_per_gpu:,} B on this GPU "
                    "(every sequence also holds the draft's KV cache)"
                ]
                if self.draft_model
                else []
            ),
            f"  KV per sequence      {self.kv_per_sequence_mib / 1024:8.2f} GiB  "
            f"({self.kv_bytes_per_token_per_gpu + self.draft_kv_bytes_per_token_per_gpu:,} B × "
            f"{self.max_model_len} tokens)",
            f"  budget               {self.budget_mib / 1024:8.2f} GiB  "
            f"(gpu_memory_utilization {self.gpu_memory_utilization:.2f} × "
            f"{self.gpu_memory_mib / 1024:.1f} GiB)",
            f"  needed for {self.concurrency} seq     {self.required_mib / 1024:8.2f} GiB  "
            f"= weights + overhead {self.overhead_mib / 1024:.2f} + {self.concurrency} × KV per sequence"
            f" -> {'fits' if self.fits else 'does NOT fit'}",
            f"  KV room              {max(0.0, self.kv_budget_mib) / 1024:8.2f} GiB  "
            f"-> max concurrency {self.max_concurrency} sequences of {self.max_model_len} tokens",
        ]


def estimate(
    model: ModelSpec,
    *,
    tp: int = 1,
    pp: int = 1,
    gpu_memory_mib: int,
    gpu_model: str = "GPU",
    quantization: Quantization = Quantization.NONE,
    dtype: Dtype = Dtype.BF16,
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    concurrency: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int | None = None,
    max_loras: int = 0,
    max_lora_rank: int = 16,
    draft: ModelSpec | None = None,
) -> MemoryEstimate:
    """Memory one GPU of a ``tp`` × ``pp`` replica of ``model`` needs on a GPU of ``gpu_memory_mib``.

    ``draft``: a speculative draft model. vLLM runs it with the target's tensor-parallel size
    (``draft_tensor_parallel_size`` defaults to it) and gives its layers KV cache blocks from the same
    pool, so each GPU holds its tp share of the draft's weights and each sequence the draft's KV too.
    The whole draft is counted on every GPU: with pp > 1 it sits on one stage, and the largest stage
    decides the fit.
    """
    if tp < 1 or pp < 1:
        raise UserError(f"tp ({tp}) and pp ({pp}) must be at least 1")
    if pp > model.num_layers:
        raise UserError(
            f"pp={pp} exceeds {model.name}'s {model.num_layers} layers; use pp ≤ {model.num_layers}"
        )
    length = max_model_len or model.max_model_len
    h = model.hidden_size
    embed_params = model.vocab_size * h
    heads_params = embed_params * (1 if model.tie_word_embeddings else 2)
    layer_params = (model.num_params - heads_params) / model.num_layers
    wbytes = weight_bytes_per_param(quantization, dtype)
    ebytes = DTYPE_BYTES[dtype]
    # vLLM gives the embedding to the first stage and the LM head to the last; with pp == 1 one GPU
    # holds both. The largest stage has ceil(layers / pp) layers plus one of them.
    if pp == 1:
        stage_bytes = model.num_layers * layer_params * wbytes + heads_params * ebytes
    else:
        stage_bytes = math.ceil(model.num_layers / pp) * layer_params * wbytes + embed_params * ebytes
    weights_mib = stage_bytes / tp / MIB

    tokens = max_num_batched_tokens or ACTIVATION_TOKENS
    intermediate = model.intermediate_size * model.experts_per_token / tp
    activation_mib = tokens * (_ACT_PER_INTERMEDIATE * intermediate + _ACT_PER_HIDDEN * h) * ebytes / MIB
    non_torch = NON_TORCH_MIB + (NCCL_MIB if tp * pp > 1 else 0.0)

    kv_tok_gpu = kv_bytes_per_token(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, tp=tp, pp=pp)
    draft_mib, draft_kv = 0.0, 0
    if draft is not None:
        draft_quant = draft.quantizations[0] if len(draft.quantizations) == 1 else Quantization.NONE
        draft_heads = draft.vocab_size * draft.hidden_size * (1 if draft.tie_word_embeddings else 2)
        draft_bytes = (draft.num_params - draft_heads) * weight_bytes_per_param(
            draft_quant, dtype
        ) + draft_heads * ebytes
        draft_mib = draft_bytes / tp / MIB
        draft_kv = kv_bytes_per_token(draft, dtype=dtype, kv_cache_dtype=kv_cache_dtype, tp=tp)
    blocks = math.ceil(length / KV_BLOCK_TOKENS)
    return MemoryEstimate(
        model=model.name,
        gpu_model=gpu_model,
        gpu_memory_mib=gpu_memory_mib,
        tp=tp,
        pp=pp,
        quantization=quantization,
        max_model_len=length,
        concurrency=concurrency,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_mib=weights_mib,
        activation_tokens=tokens,
        activation_mib=activation_mib,
        cuda_graph_mib=CUDA_GRAPH_MIB,
        non_torch_mib=non_torch,
        kv_bytes_per_token=kv_bytes_per_token(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype),
        kv_bytes_per_token_per_gpu=kv_tok_gpu,
        kv_per_sequence_mib=blocks * KV_BLOCK_TOKENS * (kv_tok_gpu + draft_kv) / MIB,
        lora_mib=lora_slots_mib(
            model, max_loras=max_loras, max_lora_rank=max_lora_rank, tp=tp, pp=pp, dtype=dtype
        )
        if max_loras
        else 0.0,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank if max_loras else 0,
        draft_model=draft.name if draft is not None else "",
        draft_weights_mib=draft_mib,
        draft_kv_bytes_per_token_per_gpu=draft_kv,
    )
