"""The domain model shared by every module: fleet, models, deployments, plans and runtime records.

Pydantic models are the only config and API boundary (see HOUSE_STYLE #17). Memory is carried in MiB as
integers, the unit ``nvidia-smi`` reports; GiB appear only in human-facing output.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

from controlplane.errors import UserError, describe_validation_error

__all__ = [
    "DTYPE_BYTES",
    "GPU",
    "IN_PLACE_FIELDS",
    "DeploymentRecord",
    "DeploymentSpec",
    "Dtype",
    "EngineKind",
    "Fleet",
    "LoraAdapter",
    "ModelSpec",
    "Node",
    "Plan",
    "ProbePaths",
    "Quantization",
    "ReplicaPlan",
    "ReplicaRecord",
    "ReplicaState",
    "RolloutRecord",
    "RolloutStatus",
    "Shard",
    "SpeculativeConfig",
    "Strategy",
    "ZeroMode",
    "spec_version",
]

_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
Name = Annotated[str, Field(min_length=1, max_length=63, pattern=_NAME_RE.pattern)]
"""A DNS-label-like name (deployments, nodes): lower case, digits, '-' and '.'."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, use_enum_values=False)


# --- fleet


class Interconnect(StrEnum):
    """How the GPUs of one node talk to each other."""

    NVLINK = "nvlink"
    PCIE = "pcie"


class GPU(_Model):
    """One GPU as ``nvidia-smi`` sees it."""

    index: int = Field(ge=0, le=63)
    """Index as used by ``CUDA_VISIBLE_DEVICES`` / ``--gpus device=``."""
    uuid: str = ""
    """``GPU-…`` UUID; empty when the GPU comes from a declared inventory rather than discovery."""
    model: str = Field(min_length=1)
    """Product name without the vendor prefix, e.g. ``A100-SXM4-80GB``."""
    memory_total_mib: int = Field(gt=0)
    memory_used_mib: int = Field(default=0, ge=0)
    pci_bus_id: str = ""
    nvlink_peers: list[int] = Field(default_factory=list)
    """Indices of GPUs reachable over NVLink (``NV#`` in ``nvidia-smi topo -m``)."""
    pcie_switch: str | None = None
    """Opaque id shared by GPUs behind the same PCIe switch (``PIX``/``PXB`` in ``topo -m``)."""
    numa_node: int | None = None
    compute_capability: str | None = Field(default=None, pattern=r"^\d{1,2}\.\d$")
    """CUDA compute capability (``nvidia-smi --query-gpu=compute_cap``), e.g. ``8.0``; it picks the GPU's
    row of the generation table. Unset for declared GPUs without ``sarv_gpu_compute_capability``."""

    @property
    def memory_free_mib(self) -> int:
        return max(0, self.memory_total_mib - self.memory_used_mib)

    @model_validator(mode="after")
    def _used_le_total(self) -> GPU:
        if self.memory_used_mib > self.memory_total_mib:
            raise ValueError(
                f"memory_used_mib ({self.memory_used_mib}) exceeds memory_total_mib ({self.memory_total_mib})"
            )
        return self


class Node(_Model):
    """One server of the fleet."""

    name: str = Field(min_length=1, max_length=253)
    address: str = Field(min_length=1)
    """Where SSH and the gateway reach it (``ansible_host`` or the inventory name)."""
    groups: list[str] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    gpus: list[GPU] = Field(default_factory=list)
    interconnect: Interconnect = Interconnect.PCIE
    nic: str | None = None
    """Interface carrying inter-node traffic; becomes ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME``."""
    ssh_user: str | None = None
    ssh_port: int = Field(default=22, ge=1, le=65535)
    ssh_key_file: str | None = None
    """Private key for SSH to this node (``ansible_ssh_private_key_file``); unset: the ``ssh_key_file``
    setting, else the agent and ``~/.ssh``."""

    @model_validator(mode="after")
    def _unique_gpu_indices(self) -> Node:
        seen = [g.index for g in self.gpus]
        if len(seen) != len(set(seen)):
            raise ValueError(f"node {self.name}: duplicate GPU indices {sorted(seen)}")
        return self

    @property
    def gpu_model(self) -> str | None:
        """The GPU model when all GPUs are the same, else None."""
        models = {g.model for g in self.gpus}
        return models.pop() if len(models) == 1 else None


class Fleet(_Model):
    """The documented fleet file (``llmctl inventory --output json|yaml``), accepted back by ``-i``."""

    version: int = Field(default=1, ge=1, le=1)
    nodes: list[Node] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> Fleet:
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate node names: {', '.join(dup)}")
        return self

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


# --- models


class Dtype(StrEnum):
    BF16 = "bfloat16"
    FP16 = "float16"
    FP32 = "float32"
    AUTO = "auto"


class Quantization(StrEnum):
    """Weight formats, highest precision first (the order ``auto`` tries them in)."""

    AUTO = "auto"
    NONE = "none"  # bf16/fp16 weights
    FP8 = "fp8"
    INT8 = "int8"
    AWQ = "awq"  # int4
    GPTQ = "gptq"  # int4


DTYPE_BYTES: dict[Dtype, float] = {
    Dtype.BF16: 2.0,
    Dtype.FP16: 2.0,
    Dtype.FP32: 4.0,
    Dtype.AUTO: 2.0,
}


class ModelSpec(_Model):
    """Architecture numbers of a model: what the memory estimator and the planner need."""

    name: str = Field(min_length=1)
    hf_id: str = ""
    """Hugging Face id, informative only: nothing is downloaded from a hub."""
    architecture: str = "LlamaForCausalLM"
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_experts: int = Field(default=1, ge=1)
    experts_per_token: int = Field(default=1, ge=1)
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool = False
    num_params: int = Field(gt=0)
    """Total parameters (all experts)."""
    max_model_len: int = Field(gt=0)
    """Default (and largest supported) context length."""
    quantizations: list[Quantization] = Field(
        default_factory=lambda: [
            Quantization.NONE,
            Quantization.FP8,
            Quantization.INT8,
            Quantization.AWQ,
            Quantization.GPTQ,
        ]
    )
    """Weight variants available for this model."""
    task: str = "generate"
    """``generate`` or ``embed``."""
    tool_call_parser: str | None = Field(default=None, pattern=r"^[a-z0-9_.-]+$")
    """vLLM's ``--tool-call-parser`` for this model family (``llama3_json``, ``hermes``, ``mistral`` …);
    unset: the model has no tool-call format vLLM can parse, and tool calling cannot be turned on."""
    tool_chat_template: str | None = None
    """A chat template for tool use when the model's own lacks one (a path inside the engine image)."""
    sources: dict[Quantization, str] = Field(default_factory=dict)
    """Weights per variant (``none: PATH_OR_URL``, ``fp8: …``): what deploy fetches for the planned one."""

    @field_validator("sources")
    @classmethod
    def _no_auto_source(cls, v: dict[Quantization, str]) -> dict[Quantization, str]:
        if Quantization.AUTO in v:
            raise ValueError("sources: 'auto' is not a variant; key sources by none, fp8, int8, awq, gptq")
        return v

    @model_validator(mode="after")
    def _heads(self) -> ModelSpec:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token cannot exceed num_experts")
        return self


# --- deployments


class Strategy(StrEnum):
    BINPACK = "binpack"
    SPREAD = "spread"


class EngineKind(StrEnum):
    VLLM = "vllm"
    VLLM_CPU = "vllm-cpu"
    SIM = "sim"


class LoraAdapter(_Model):
    """One LoRA adapter served on the deployment's base model, routable as a model of its own."""

    name: str = Field(min_length=1, pattern=r"^[^=,\s]+$")
    source: str | None = None
    """Adapter weights on the node (vLLM's ``NAME=PATH``); None for engines that need none (``sim``)."""

    @classmethod
    def parse_list(cls, text: str) -> list[LoraAdapter]:
        """``name=path,name2=path2`` (or bare names for ``sim``) → adapters; a one-line error otherwise."""
        out: list[LoraAdapter] = []
        for entry in (e.strip() for e in text.split(",")):
            if not entry:
                continue
            name, eq, source = (p.strip() for p in entry.partition("="))
            if not name or (eq and not source) or any(c.isspace() for c in name):
                raise UserError(f"lora_modules entry {entry!r} must be NAME=PATH (or NAME for sim)")
            out.append(cls(name=name, source=source or None))
        names = [a.name for a in out]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise UserError(f"LoRA adapter {dup[0]!r} is given twice")
        return out

    def as_module(self) -> str:
        """vLLM's ``--lora-modules`` entry: ``NAME=PATH``, or ``NAME`` alone."""
        return self.name if self.source is None else f"{self.name}={self.source}"


class SpeculativeConfig(_Model):
    """vLLM's ``--speculative-config``: n-gram lookup, a draft model, or another method vLLM knows."""

    method: str | None = Field(default=None, min_length=1)
    """``ngram``, ``eagle``, ``mtp`` …; None with ``model`` set is a draft model."""
    model: str | None = Field(default=None, min_length=1)
    """Draft (or EAGLE head) model directory."""
    num_speculative_tokens: int | None = Field(default=None, ge=1, le=128)
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    """Longest n-gram the ``ngram`` method looks up in the prompt."""
    options: dict[str, JsonValue] = Field(default_factory=dict)
    """Further keys of vLLM's JSON object, passed through unchanged."""

    @model_validator(mode="after")
    def _method_or_model(self) -> SpeculativeConfig:
        if self.method is None and self.model is None:
            raise ValueError("speculative_config needs a method or a draft model")
        return self

    @classmethod
    def parse(cls, value: str | int | float | bool) -> SpeculativeConfig:
        """``ngram[:N]``, ``draft:MODEL[:N]`` or a JSON object; a one-line error otherwise."""
        text = str(value).strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except ValueError as exc:
                raise UserError(f"speculative_config is not valid JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise UserError("speculative_config must be a JSON object")
            known = {k: obj.pop(k) for k in list(obj) if k in cls.model_fields and k != "options"}
            return cls._checked({**known, "options": obj})
        kind, _, rest = text.partition(":")
        if kind == "ngram" and (not rest or rest.isdigit()):
            n = int(rest) if rest else 4
            return cls._checked({"method": "ngram", "num_speculative_tokens": n, "prompt_lookup_max": 4})
        if kind == "draft" and rest:
            model, n = rest, 4
            head, sep, tail = rest.rpartition(":")
            if sep and tail.isdigit():
                model, n = head, int(tail)
            return cls._checked({"model": model, "num_speculative_tokens": n})
        raise UserError(
            f"speculative_config {text!r} not understood",
            hint='use "ngram", "ngram:N", "draft:MODEL[:N]" or a JSON object',
        )

    @classmethod
    def _checked(cls, data: dict[str, Any]) -> SpeculativeConfig:
        if data.get("method") is None and data.get("model") is None:
            raise UserError("speculative_config needs a method or a draft model")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise UserError(describe_validation_error(exc, what="speculative_config")) from None

    def as_vllm_json(self) -> str:
        """The JSON object vLLM's ``--speculative-config`` takes."""
        known = self.model_dump(exclude={"options"}, exclude_none=True)
        return json.dumps({**self.options, **known}, sort_keys=True)


class DeploymentSpec(_Model):
    """What the user asks for: ``llmctl deploy``/``plan`` options, validated."""

    name: Name
    model: str = Field(min_length=1)
    replicas: int = Field(default=1, ge=1, le=1024)
    min_replicas: int | None = Field(default=None, ge=1, le=1024)
    """Fewest replicas the controller's autoscaler may leave; None: the controller's policy decides
    (its default: ``replicas``, no scaling)."""
    max_replicas: int | None = Field(default=None, ge=1, le=1024)
    """Most replicas the controller's autoscaler may start; None: the controller's policy decides."""
    tp: int = Field(default=1, ge=1, le=64)
    pp: int | None = Field(default=None, ge=1, le=64)
    """None lets the planner pick the smallest pipeline depth that fits."""
    quantization: Quantization = Quantization.NONE
    dtype: Dtype = Dtype.BF16
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = Field(default=None, ge=16, le=1 << 22)
    concurrency: int = Field(default=1, ge=1, le=65536)
    """Target number of max_model_len sequences the KV cache must hold at once."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.05, le=0.99)
    strategy: Strategy = Strategy.BINPACK
    engine: EngineKind = EngineKind.VLLM
    engine_args: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra engine options (``max_num_seqs``, ``enable_prefix_caching`` …)."""
    lora_adapters: list[LoraAdapter] = Field(default_factory=list)
    """LoRA adapters on the base model (vLLM's ``--enable-lora --lora-modules``)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (vLLM's ``--speculative-config``); None turns it off."""
    source: str | None = None
    """Weights of the planned variant: a local directory or an http(s)/s3 URL with a sha256 manifest."""
    sources: dict[Quantization, str] = Field(default_factory=dict)
    """Weights per variant (``--source fp8=PATH``); they win over ``source`` and the catalog's."""
    tools: bool = False
    """Tool calling: vLLM's auto tool choice with the catalog's tool-call parser for the model."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Only nodes whose labels contain all these pairs."""
    scale_to_zero: bool | None = None
    """After ``idle_timeout_s`` without a request the controller takes the deployment to zero (its
    replicas asleep where the engine has vLLM's sleep mode, else stopped) and the gateway holds the next
    requests while it wakes; None: the controller's policy decides (its default: off)."""
    idle_timeout_s: float | None = Field(default=None, ge=1, le=7 * 86_400)
    """Seconds without a request before a ``scale_to_zero`` deployment goes to zero; None: the
    controller's policy's (default 300)."""

    @model_validator(mode="before")
    @classmethod
    def _typed_engine_args(cls, data: Any) -> Any:
        """Lift ``lora_modules``/``speculative_config`` engine args (``--engine-arg``, records written
        before the typed fields existed) into ``lora_adapters``/``speculative``: the one place they are
        parsed."""
        if not isinstance(data, dict) or not isinstance(data.get("engine_args"), dict):
            return data
        args = dict(data["engine_args"])
        lora = args.pop("lora_modules", None)
        speculative = args.pop("speculative_config", None)
        if lora is None and speculative is None:
            return data
        data = {**data, "engine_args": args}
        if lora is not None:
            if data.get("lora_adapters"):
                raise UserError("LoRA adapters are given twice: as lora_modules and as lora_adapters")
            data["lora_adapters"] = LoraAdapter.parse_list(str(lora))
        if speculative is not None:
            if data.get("speculative") is not None:
                raise UserError("speculative decoding is given twice: as speculative_config and speculative")
            data["speculative"] = SpeculativeConfig.parse(speculative)
        return data

    @model_validator(mode="after")
    def _replica_bounds(self) -> DeploymentSpec:
        low, high = self.min_replicas, self.max_replicas
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_replicas ({low}) exceeds max_replicas ({high})")
        if self.idle_timeout_s is not None and self.scale_to_zero is False:
            raise ValueError("idle_timeout_s needs scale_to_zero: true (or leave idle_timeout_s out)")
        return self

    @field_validator("sources")
    @classmethod
    def _no_auto_source(cls, v: dict[Quantization, str]) -> dict[Quantization, str]:
        if Quantization.AUTO in v:
            raise ValueError("sources: 'auto' is not a variant; give --source VARIANT=PATH per variant")
        return v

    @field_validator("engine_args")
    @classmethod
    def _engine_arg_names(cls, v: dict[str, str | int | float | bool]) -> dict[str, str | int | float | bool]:
        for key in v:
            if not re.fullmatch(r"[a-z][a-z0-9_]*", key):
                raise ValueError(f"engine argument {key!r} must be snake_case (e.g. max_num_seqs)")
        return v


class Shard(_Model):
    """One pipeline stage of a replica: ``tp`` GPUs of one node."""

    node: str
    gpus: list[int]
    pp_rank: int = Field(ge=0)


class ReplicaPlan(_Model):
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    quantization: Quantization = Quantization.NONE
    dtype: Dtype | None = None
    """Activation dtype the engine runs in: the request's, as the GPU generation allows (bf16 → fp16
    before Ampere); None in plans recorded before the planner chose it (the request's then)."""
    kv_cache_dtype: str | None = None
    """vLLM's ``--kv-cache-dtype`` for this replica; None: the request's."""
    generation: str | None = None
    """Row of the GPU-generation table the replica's GPUs belong to (None: CPU placement)."""
    shards: list[Shard]
    per_gpu_memory_gib: float
    max_concurrency: int = Field(ge=0)


class Plan(_Model):
    """The planner's answer. ``model_dump(include=…)`` of the documented keys is the JSON contract."""

    model: str
    deployment: str = ""
    replicas: list[ReplicaPlan] = Field(default_factory=list)
    unplaced: int = Field(default=0, ge=0)
    reasons: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    """Informational lines (e.g. why ``--quantization auto`` chose a variant)."""


# --- runtime


class ReplicaState(StrEnum):
    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    FAILED = "failed"
    DRAINING = "draining"
    """Being removed: the gateway routes no new request to it while its in-flight ones finish."""
    STOPPING = "stopping"
    SLEEPING = "sleeping"
    """Scaled to zero in vLLM's sleep mode: weights offloaded, GPU memory freed, the process kept; the
    gateway routes nothing to it until the controller wakes it (``POST /wake_up``)."""


class ProbePaths(_Model):
    """Where an engine answers its probes, relative to the replica's endpoint; declared by the engine
    (``EngineLaunch.probes``) and carried by its replica record. The defaults are vLLM's OpenAI server's,
    which every engine kind Sarv runs serves (the simulator included)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    health: str = Field(default="/health", pattern=r"^/")
    """Answers 200 while the server lives (vLLM's can answer before the model is loaded)."""
    ready: str = Field(default="/v1/models", pattern=r"^/")
    """Answers 200 only once the model is loaded: the model list, with each model's context length."""
    metrics: str = Field(default="/metrics", pattern=r"^/")
    """Prometheus text exposition of the engine's load (``engines.metrics`` parses it)."""


class ReplicaRecord(_Model):
    """Observed state of one running replica; what the gateway routes to."""

    id: str
    """``<deployment>-<index>``."""
    deployment: str
    index: int = Field(ge=0)
    model: str
    """Served model name (what clients put in ``"model"``)."""
    engine: EngineKind
    shards: list[Shard] = Field(default_factory=list)
    node: str
    """Node of pp rank 0 (where the API server listens)."""
    endpoint: str | None = None
    """Base URL, e.g. ``http://127.0.0.1:8101``; None until the engine listens."""
    state: ReplicaState = ReplicaState.PENDING
    adapters: list[str] = Field(default_factory=list)
    """LoRA adapter names served by this replica (routable as models)."""
    weights: str | None = None
    """The verified weights it runs, as ``<model>/<manifest digest>`` in a model cache: where a gateway
    on a host holding the same cache finds the tokenizer (exact prompt lengths)."""
    capacity: float = Field(default=1.0, gt=0)
    """Relative throughput, used to normalise load across heterogeneous replicas."""
    probes: ProbePaths = Field(default_factory=ProbePaths)
    """The engine's health, readiness and metrics paths."""
    handle: dict[str, str] = Field(default_factory=dict)
    """Launcher bookkeeping (pid, unit name, log path …)."""
    version: str = ""
    """The deployment version it runs (:func:`spec_version` of the spec it was started with); "" in
    records written before versions existed, which count as the deployment's stable version."""
    message: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0


class ZeroMode(StrEnum):
    """How a deployment scaled to zero left its replicas."""

    SLEEP = "sleep"
    """Asleep (vLLM's sleep mode, level 1): woken with ``POST /wake_up`` in seconds."""
    STOP = "stop"
    """Stopped: one is started again (a cold start)."""


class DeploymentRecord(_Model):
    """Desired state of one deployment."""

    spec: DeploymentSpec
    plan: Plan
    zero: ZeroMode | None = None
    """Set while the controller holds the deployment at zero (``scale_to_zero``), until a replica is
    ready again; the gateway holds its requests meanwhile. None: serving as usual."""
    zero_since: float = 0.0
    """Wall-clock time it went to zero."""
    launching_until: float = 0.0
    """Set while ``llmctl deploy`` (or a scale) is landing weights and starting replicas, cleared when it
    is done: the controller leaves the deployment alone until then (wall clock; a crashed deploy's mark
    runs out), instead of starting replicas of its own for a plan whose replicas are not recorded yet."""
    launching_by: str = ""
    """Who set ``launching_until``: the lease holder of the controller whose scale is launching, empty for
    ``llmctl``. A controller that holds the lease ignores another holder's mark: that controller lost the
    lease (it died mid-scale), and its mark would otherwise keep the deployment unmanaged until it ran out."""
    created_at: float = 0.0
    updated_at: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.name


IN_PLACE_FIELDS = frozenset({"replicas", "min_replicas", "max_replicas", "scale_to_zero", "idle_timeout_s"})
"""Fields that size a deployment or say when it scales, without changing what its replicas run: not part
of its version, changed in place (``llmctl deploy``/``apply``), never rolled out."""


def spec_version(spec: DeploymentSpec) -> str:
    """A short digest of what ``spec``'s replicas run (everything but :data:`IN_PLACE_FIELDS`): two replicas
    with the same version are interchangeable, and a rollout is a change of version."""
    body = spec.model_dump(mode="json", exclude=set(IN_PLACE_FIELDS))
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:10]


class RolloutStatus(StrEnum):
    PROGRESSING = "progressing"
    """The canary takes the current step's share of traffic; the controller compares and promotes."""
    ROLLING_BACK = "rolling-back"
    """The canary takes no traffic; the stable version is brought back to its replica count, then the
    canary replicas are stopped."""
    SUCCEEDED = "succeeded"
    """The new version runs every replica and is the deployment's spec."""
    ROLLED_BACK = "rolled-back"
    """Exactly the old version runs, as before the rollout."""


class RolloutRecord(_Model):
    """One deployment's rollout (``llmctl rollout``), kept in the state store: what the controller needs
    to go on after a restart. One per deployment; a finished one stays until the next starts."""

    deployment: Name
    stable: DeploymentSpec
    """The version running before the rollout (what a rollback leaves)."""
    canary: DeploymentSpec
    """The new version."""
    stable_version: str
    canary_version: str
    steps: list[int] = Field(default_factory=lambda: [10, 50, 100], min_length=1, max_length=20)
    """Canary traffic shares in percent, increasing, the last 100."""
    step: int = Field(default=0, ge=0)
    """Index into ``steps`` of the current share."""
    status: RolloutStatus = RolloutStatus.PROGRESSING
    reason: str = ""
    """The last decision, in one line (why it holds, promoted or rolled back)."""
    comparison: dict[str, float | None] = Field(default_factory=dict)
    """The last comparison's numbers: ``canary_ttft_p95_s``, ``stable_error_ratio``, ``canary_requests`` …"""
    started_at: float = 0.0
    step_started_at: float = 0.0
    """When the current step's share took effect."""
    updated_at: float = 0.0

    @field_validator("steps")
    @classmethod
    def _increasing_to_100(cls, v: list[int]) -> list[int]:
        if any(not 0 < w <= 100 for w in v) or any(b <= a for a, b in itertools.pairwise(v)):
            raise ValueError(f"steps {v} must increase, each in 1..100")
        if v[-1] != 100:
            raise ValueError(f"steps {v} must end at 100 (the canary takes all traffic last)")
        return v

    @property
    def weight(self) -> int:
        """The canary's share of traffic now, in percent (0 once it is rolling back or finished)."""
        return self.steps[self.step] if self.status is RolloutStatus.PROGRESSING else 0

    @property
    def active(self) -> bool:
        return self.status in {RolloutStatus.PROGRESSING, RolloutStatus.ROLLING_BACK}
