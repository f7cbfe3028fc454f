"""The engine adapter interface: how to run one replica of an engine, wherever a launcher runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from controlplane.errors import UserError
from controlplane.spec import DeploymentSpec, EngineKind, Shard

__all__ = [
    "SARV_ENGINE_ARGS",
    "Engine",
    "EngineLaunch",
    "ReplicaContext",
    "vllm_server_args",
]

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
        "lora_modules",
        "speculative_config",
        "trust_remote_code",
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
    health_path: str = "/health"
    ready_path: str = "/v1/models"
    """Answers 200 only once the model is loaded (vLLM's ``/health`` can answer earlier)."""
    metrics_path: str = "/metrics"
    container_name: str | None = None
    """For container engines: the name ``docker stop``/``docker logs`` address."""


@runtime_checkable
class Engine(Protocol):
    """One engine kind. Pure: builds commands, never starts anything (launchers do)."""

    @property
    def kind(self) -> EngineKind: ...

    @property
    def needs_weights(self) -> bool:
        """Whether the launcher must land verified weights on the node before starting it."""
        ...

    def build(self, ctx: ReplicaContext) -> EngineLaunch: ...


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _speculative(value: str | int | float | bool) -> str:
    """``ngram[:N]``, ``draft:MODEL_DIR[:N]`` or a JSON object, as vLLM's ``--speculative-config`` JSON."""
    text = str(value)
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise UserError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise UserError("speculative_config must be a JSON object")
        return json.dumps(obj, sort_keys=True)
    kind, _, rest = text.partition(":")
    if kind == "ngram":
        n = int(rest) if rest.isdigit() else 4
        return json.dumps({"method": "ngram", "num_speculative_tokens": n, "prompt_lookup_max": 4})
    if kind == "draft" and rest:
        model, n = rest, 4
        head, sep, tail = rest.rpartition(":")
        if sep and tail.isdigit():
            model, n = head, int(tail)
        return json.dumps({"model": model, "num_speculative_tokens": n})
    raise UserError(
        f"speculative_config {text!r} not understood",
        hint='use "ngram", "ngram:N", "draft:MODEL[:N]" or a JSON object',
    )


def _lora_modules(value: str | int | float | bool) -> list[str]:
    """``name=path,name2=path2`` → ``--lora-modules name=path name2=path2`` (several adapters, one base)."""
    mods = [m.strip() for m in str(value).split(",") if m.strip()]
    for m in mods:
        name, eq, path = m.partition("=")
        if not eq or not name or not path:
            raise UserError(f"lora_modules entry {m!r} must be NAME=PATH")
    return mods


def lora_adapter_names(spec: DeploymentSpec) -> list[str]:
    value = spec.engine_args.get("lora_modules")
    return [m.partition("=")[0] for m in _lora_modules(value)] if value else []


def vllm_server_args(ctx: ReplicaContext, *, model_path: str, host: str, port: int) -> list[str]:
    """vLLM OpenAI-server flags for a deployment (shared by the container and the CPU process engines)."""
    spec = ctx.spec
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
        str(spec.tp),
        "--pipeline-parallel-size",
        str(spec.pp or 1),
        "--dtype",
        spec.dtype.value,
    ]
    max_len = ctx.max_model_len or spec.max_model_len
    if max_len:
        args += ["--max-model-len", str(max_len)]
    if spec.quantization.value in {"awq", "gptq", "fp8"}:
        args += ["--quantization", spec.quantization.value]
    elif spec.quantization.value == "int8":
        # vLLM reads int8 schemes (compressed-tensors, bitsandbytes) from the checkpoint's config.
        pass
    if spec.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", spec.kv_cache_dtype]
    extra = spec.engine_args
    if extra.get("trust_remote_code") is True:
        args.append("--trust-remote-code")
    if extra.get("lora_modules"):
        args += ["--enable-lora", "--lora-modules", *_lora_modules(extra["lora_modules"])]
    if extra.get("speculative_config"):
        args += ["--speculative-config", _speculative(extra["speculative_config"])]
    for key, value in sorted(extra.items()):
        if key in _MANAGED_ARGS or key in SARV_ENGINE_ARGS or key == "enable_lora":
            continue
        if isinstance(value, bool):
            args.append(_flag(key) if value else "--no-" + key.replace("_", "-"))
        else:
            args += [_flag(key), str(value)]
    return args


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
    }
    for key in spec.engine_args:
        if key in instead:
            raise UserError(f"engine option {key} is set by Sarv; use {instead[key]} instead")
    if "speculative_config" in spec.engine_args:
        _speculative(spec.engine_args["speculative_config"])
    if "lora_modules" in spec.engine_args:
        _lora_modules(spec.engine_args["lora_modules"])
