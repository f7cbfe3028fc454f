"""The engine adapter interface: how to run one replica of an engine, wherever a launcher runs it."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from controlplane.errors import UserError
from controlplane.spec import DeploymentSpec, EngineKind, ProbePaths, Quantization, ReplicaPlan, Shard

__all__ = [
    "SARV_ENGINE_ARGS",
    "VLLM_QUANTIZATION",
    "Engine",
    "EngineLaunch",
    "ReplicaContext",
    "check_engine_args",
    "lora_enabled",
    "lora_env",
    "sleep_env",
    "vllm_server_args",
]

VLLM_QUANTIZATION: dict[Quantization, str] = {
    Quantization.FP8: "fp8",
    Quantization.INT8: "compressed-tensors",
    Quantization.AWQ: "awq",
    Quantization.GPTQ: "gptq",
}
"""vLLM's ``--quantization`` for each variant when the checkpoint's own ``quant_method`` is not known
(int8 checkpoints are W8A8 compressed-tensors ones); deploy passes the checkpoint's method instead."""

# engine_args keys Sarv consumes itself; they are policy switches, not engine flags.
SARV_ENGINE_ARGS = frozenset({"allow_pickle_weights", "kv_cache_space_gib", "omp_threads_bind"})
# Flags Sarv sets from the plan and the launcher; a user value would contradict them (or, for
# api_key, put a secret in the process list).
_MANAGED_ARGS = frozenset(
    {
        "model",
        "served_model_name",
        "host",
        "port",
        "api_key",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "gpu_memory_utilization",
        "max_model_len",
        "quantization",
        "kv_cache_dtype",
        "dtype",
        "trust_remote_code",
        "enable_auto_tool_choice",
        "tool_call_parser",
    }
)


class ReplicaContext(BaseModel):
    """Everything an engine needs to build one replica's command; launchers fill in host and port."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replica_id: str = Field(min_length=1)
    spec: DeploymentSpec
    served_model_name: str = Field(min_length=1)
    model_dir: Path | None = None
    """Verified weights on the node (None for engines that need none, like ``sim``)."""
    host: str = "127.0.0.1"
    """Address the API server binds to on the node."""
    port: int = Field(ge=1, le=65535)
    shards: list[Shard] = Field(default_factory=list)
    gpu_ids: list[str] = Field(default_factory=list)
    """GPUs of the pp-rank-0 shard as the container runtime names them: UUIDs where known, else indices."""
    api_key: SecretStr | None = None
    """Key the engine requires on ``/v1/*``; passed through the environment, never in argv."""
    env_file: Path | None = None
    """Where the launcher writes secret environment (mode 0600) for engines run as containers."""
    python: str = "python3"
    """Interpreter for process engines (the launcher's own venv on this host)."""
    max_model_len: int | None = None
    """Context length after the catalog's default was applied."""
    gpu_memory_mib: int | None = Field(default=None, gt=0)
    """Memory of each GPU of the pp-rank-0 node, as the fleet declares or discovered it."""
    planned_gpu_memory_mib: int | None = Field(default=None, gt=0)
    """Per-GPU memory the plan gives this replica (weights, KV cache, overhead)."""
    replica: ReplicaPlan | None = None
    """The recorded plan of this replica: its tp, pp, variant, dtype and KV-cache dtype are what the
    engine runs (None: the request's, for callers without a plan)."""
    quantization_method: str | None = None
    """vLLM's ``--quantization`` value read from the checkpoint's ``quantization_config.quant_method``."""
    image: str | None = None
    """Engine image for this replica's GPU generation (container engines)."""
    tool_call_parser: str | None = None
    """vLLM's ``--tool-call-parser`` when the deployment turns tool calling on."""
    tool_chat_template: str | None = None
    """``--chat-template`` for tool use, where the catalog gives one."""


class EngineLaunch(BaseModel):
    """A launchable command: argv, environment, and where to probe it once it listens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    argv: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    """Non-secret environment added to the launcher's base environment."""
    secret_env: dict[str, SecretStr] = Field(default_factory=dict)
    """Secret environment: exported to a process, or written to ``env_file`` (0600) for a container."""
    port: int = Field(ge=1, le=65535)
    """Port the API server listens on, on the node's address."""
    probes: ProbePaths = Field(default_factory=ProbePaths)
    """Health, readiness and metrics paths; the deployer copies them into the replica record."""
    container_name: str | None = None
    """For container engines: the name ``docker stop``/``docker logs`` address."""
    ray_member_argv: list[str] = Field(default_factory=list)
    """For a container engine whose replica spans nodes: the ``docker run`` argv of one Ray cluster member
    up to the image, with ``{name}`` and ``{gpus}`` for the group launcher to fill per node; the launcher
    appends ``ray start …``. Empty: members run the node venv's ``ray`` (process engines)."""
    stage_gpus: dict[str, list[str]] = Field(default_factory=dict)
    """GPU ids (UUIDs, else indices) of the replica's stages by node, for a group launcher whose
    cluster members must offer exactly those GPUs (Ray's ``--num-gpus``); empty without GPUs."""


@runtime_checkable
class Engine(Protocol):
    """One engine kind. Pure: builds commands, never starts anything (launchers do)."""

    @property
    def kind(self) -> EngineKind: ...

    @property
    def needs_weights(self) -> bool:
        """Whether the launcher must land verified weights on the node before starting it."""
        ...

    @property
    def multi_node(self) -> bool:
        """Whether one replica may span nodes (pipeline stages joined by the group launcher)."""
        ...

    def build(self, ctx: ReplicaContext) -> EngineLaunch: ...


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _tool_args(ctx: ReplicaContext) -> list[str]:
    """vLLM's auto tool choice with the catalog's parser (and chat template) when tools are on."""
    if not ctx.spec.tools:
        return []
    if ctx.tool_call_parser is None:
        raise UserError(f"deployment {ctx.spec.name}: tool calling needs the model's tool-call parser")
    args = ["--enable-auto-tool-choice", "--tool-call-parser", ctx.tool_call_parser]
    if ctx.tool_chat_template:
        args += ["--chat-template", ctx.tool_chat_template]
    return args


def vllm_server_args(ctx: ReplicaContext, *, model_path: str, host: str, port: int) -> list[str]:
    """vLLM OpenAI-server flags for a deployment (shared by the container and the CPU process engines)."""
    spec = ctx.spec
    rp = ctx.replica
    tp = rp.tp if rp is not None else spec.tp
    pp = rp.pp if rp is not None else spec.pp or 1
    quant = rp.quantization if rp is not None else spec.quantization
    dtype = rp.dtype if rp is not None and rp.dtype is not None else spec.dtype
    kv = rp.kv_cache_dtype if rp is not None and rp.kv_cache_dtype is not None else spec.kv_cache_dtype
    args = [
        "--model",
        model_path,
        "--served-model-name",
        ctx.served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tp),
        "--pipeline-parallel-size",
        str(pp),
        "--dtype",
        dtype.value,
    ]
    max_len = ctx.max_model_len or spec.max_model_len
    if max_len:
        args += ["--max-model-len", str(max_len)]
    method = ctx.quantization_method or VLLM_QUANTIZATION.get(quant)
    if method is not None and quant is not Quantization.NONE:
        args += ["--quantization", method]
    if kv != "auto":
        args += ["--kv-cache-dtype", kv]
    args += _tool_args(ctx)
    extra = spec.engine_args
    if extra.get("trust_remote_code") is True:
        args.append("--trust-remote-code")
    if lora_enabled(spec):
        args.append("--enable-lora")
    if spec.lora_adapters:
        args += ["--lora-modules", *(a.as_module() for a in spec.lora_adapters)]
    if spec.speculative is not None:
        args += ["--speculative-config", spec.speculative.as_vllm_json()]
    for key, value in sorted(extra.items()):
        if key in _MANAGED_ARGS or key in SARV_ENGINE_ARGS or key == "enable_lora":
            continue
        if isinstance(value, bool):
            args.append(_flag(key) if value else "--no-" + key.replace("_", "-"))
        else:
            args += [_flag(key), str(value)]
    return args


def lora_enabled(spec: DeploymentSpec) -> bool:
    """Whether the deployment serves LoRA adapters: it has some, or ``enable_lora`` asks for later ones."""
    return bool(spec.lora_adapters) or spec.engine_args.get("enable_lora") is True


def lora_env(spec: DeploymentSpec) -> dict[str, str]:
    """vLLM's switch for ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``; only with LoRA on."""
    return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora_enabled(spec) else {}


def sleep_env(spec: DeploymentSpec) -> dict[str, str]:
    """vLLM serves ``/sleep`` and ``/wake_up`` (scale to zero's fast path) only in its development mode:
    set with ``enable_sleep_mode``. Those routes are unauthenticated on the replica's port; see
    docs/controller.md (Scale to zero)."""
    return {"VLLM_SERVER_DEV_MODE": "1"} if spec.engine_args.get("enable_sleep_mode") is True else {}


def check_engine_args(spec: DeploymentSpec) -> None:
    """Refuse engine options Sarv manages itself, with the deploy option to use instead."""
    instead = {
        "model": "the MODEL argument",
        "served_model_name": "--name",
        "host": "the launcher",
        "port": "--port",
        "api_key": "an API key file (never the command line)",
        "tensor_parallel_size": "--tp",
        "pipeline_parallel_size": "--pp",
        "gpu_memory_utilization": "--gpu-memory-utilization",
        "max_model_len": "--max-model-len",
        "quantization": "--quantization",
        "kv_cache_dtype": "--kv-cache-dtype",
        "dtype": "--dtype",
        "enable_auto_tool_choice": "--tools",
        "tool_call_parser": "--tools (the catalog's parser for the model)",
    }
    for key in spec.engine_args:
        if key in instead:
            raise UserError(f"engine option {key} is set by Sarv; use {instead[key]} instead")
    if spec.engine in {EngineKind.VLLM, EngineKind.VLLM_CPU}:
        for adapter in spec.lora_adapters:
            if adapter.source is None:
                raise UserError(f"LoRA adapter {adapter.name!r} has no weights: give it as NAME=PATH")
