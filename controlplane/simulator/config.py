"""The simulator's configuration: every field is also a command-line option (``--max-num-seqs`` …)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["LatencyMode", "SimConfig", "SimTask"]


class LatencyMode(StrEnum):
    """How response timing is produced."""

    MODEL = "model"
    """TTFT from the prefill model (base + uncached tokens × per-token time), ITL per token, load slowdown."""
    FIXED = "fixed"
    """Fixed TTFT, fixed ITL and a fixed number of output tokens: a flat upstream for proxy benchmarks."""


class SimTask(StrEnum):
    GENERATE = "generate"
    EMBED = "embed"


class SimConfig(BaseModel):
    """One simulated vLLM replica. Defaults follow an 8B model on one H100 (REFERENCE.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    model: str | None = None
    """Accepted for command-line compatibility with vLLM (``--model DIR``); reported as the model's root."""
    served_model_name: str = Field(default="sim", min_length=1, max_length=256)
    """Name clients put in ``"model"``."""
    api_key: str | None = Field(default=None, repr=False)
    """Bearer token required on ``/v1/*`` (vLLM's ``--api-key``); the command line also reads
    ``VLLM_API_KEY`` so the key need not appear in the process list."""
    task: SimTask = SimTask.GENERATE
    """``embed`` serves ``/v1/embeddings`` instead of completions."""
    lora_modules: list[str] = Field(default_factory=list)
    """LoRA adapters served as extra models: ``name`` or vLLM's ``name=path``."""
    max_model_len: int = Field(default=4096, ge=16, le=1 << 22)
    max_num_seqs: int = Field(default=256, ge=1, le=65536)
    """Sequences decoded at once; further requests wait in a FIFO queue."""
    kv_cache_tokens: int = Field(default=65536, ge=16, le=1 << 30)
    """KV cache capacity in tokens, shared by running sequences and the prefix cache."""
    block_size: int = Field(default=16, ge=1, le=1024)
    enable_prefix_caching: bool = True
    ttft_ms: float = Field(default=30.0, ge=0, le=600_000)
    """Base time to first token (scheduling + one forward pass)."""
    prefill_ms_per_token: float = Field(default=0.25, ge=0, le=1000)
    """Added to the TTFT for each prompt token not found in the prefix cache."""
    itl_ms: float = Field(default=12.0, ge=0, le=60_000)
    """Inter-token latency with a single running sequence."""
    load_factor: float = Field(default=1.0, ge=1.0, le=100.0)
    """Latency multiplier when all ``max_num_seqs`` slots run; scales linearly from 1 with one sequence."""
    output_tokens: int = Field(default=32, ge=1, le=1 << 20)
    """Output length when a request sets no ``max_tokens`` (finish reason ``stop``)."""
    seed: int = 0
    """Seeds output text, embeddings and failure draws, so runs are reproducible."""
    latency_mode: LatencyMode = LatencyMode.MODEL
    fixed_ttft_ms: float = Field(default=20.0, ge=0, le=600_000)
    fixed_itl_ms: float = Field(default=5.0, ge=0, le=60_000)
    fixed_output_tokens: int = Field(default=16, ge=1, le=1 << 20)
    """Output tokens of every request in fixed mode, whatever ``max_tokens`` says."""
    failure_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Fraction of inference requests answered with HTTP 500."""
    hang_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    """Fraction of inference requests that are never answered (until the client gives up)."""
    crash_after: int | None = Field(default=None, ge=1)
    """Exit the process (status 1) once this many inference requests have finished."""
    exit_at_start: int | None = Field(default=None, ge=1, le=255)
    """Exit with this status right after start, before listening: an engine that cannot start (a crash
    loop rehearsal)."""
    slow_start_s: float = Field(default=0.0, ge=0.0, le=3600.0)
    """Answer 503 on ``/health`` and ``/v1/*`` for this long after start, like an engine still loading."""
    embedding_dim: int = Field(default=384, ge=1, le=16384)
    # --- vLLM's sleep mode (routes only with VLLM_SERVER_DEV_MODE=1, as vLLM)
    enable_sleep_mode: bool = False
    """vLLM's ``--enable-sleep-mode``: ``POST /sleep`` frees the GPU, ``POST /wake_up`` restores it."""
    sleep_s: float = Field(default=0.2, ge=0.0, le=600.0)
    """Time ``/sleep`` takes (level 1: weights copied to host memory; level 2: discarded)."""
    wake_s: float = Field(default=0.5, ge=0.0, le=600.0)
    """Time ``/wake_up`` takes after a level-1 sleep (weights copied back from host memory)."""
    wake_level2_s: float = Field(default=5.0, ge=0.0, le=3600.0)
    """Time ``/wake_up`` takes after a level-2 sleep (weights reloaded from the model cache)."""
    # --- standing in for a GPU engine (checked at start-up by ``controlplane.simulator.gpu``)
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    pipeline_parallel_size: int = Field(default=1, ge=1, le=64)
    local_pipeline_stages: int | None = Field(default=None, ge=1, le=64)
    """Pipeline stages this process runs on its node (pp across nodes); unset: all of them."""
    gpu_memory_mib: int | None = Field(default=None, gt=0)
    """Memory of each fake GPU (the node's declared GPU memory); unset: no memory check."""
    planned_gpu_memory_mib: int | None = Field(default=None, gt=0)
    """Memory the plan gives each GPU (weights + KV cache + overhead)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    quantization: str | None = None
    """vLLM's ``--quantization``; checked against the weights' ``config.json`` when ``--model`` has one."""
    dtype: str = "auto"

    @model_validator(mode="after")
    def _consistent(self) -> SimConfig:
        if self.failure_rate + self.hang_rate > 1.0:
            raise ValueError(
                f"failure_rate ({self.failure_rate}) + hang_rate ({self.hang_rate}) must not exceed 1"
            )
        if self.max_model_len > self.kv_cache_tokens:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds kv_cache_tokens ({self.kv_cache_tokens}): "
                "one full-length sequence must fit the KV cache; raise kv_cache_tokens"
            )
        names = [self.served_model_name, *self.adapter_names]
        if len(set(names)) != len(names):
            raise ValueError(f"model and adapter names must be unique: {', '.join(names)}")
        return self

    @property
    def adapter_names(self) -> list[str]:
        return [m.split("=", 1)[0] for m in self.lora_modules]

    @property
    def model_names(self) -> list[str]:
        """Every name this replica answers to: the served model, then its adapters."""
        return [self.served_model_name, *self.adapter_names]
