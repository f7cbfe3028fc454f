"""The ``sim`` engine: Sarv's vLLM-compatible simulator (``controlplane.simulator``) as a process."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.engines.base import SARV_ENGINE_ARGS, EngineLaunch, ReplicaContext, lora_env, sleep_env
from controlplane.spec import EngineKind

__all__ = ["SimEngine"]


def _gpu_stand_in_args(ctx: ReplicaContext) -> list[str]:
    spec = ctx.spec
    shard0 = min(ctx.shards, key=lambda s: s.pp_rank) if ctx.shards else None
    here = sum(1 for s in ctx.shards if shard0 is not None and s.node == shard0.node) or None
    args = [
        "--tensor-parallel-size",
        str(spec.tp),
        "--pipeline-parallel-size",
        str(spec.pp or 1),
        "--gpu-memory-utilization",
        str(spec.gpu_memory_utilization),
        "--dtype",
        spec.dtype.value,
    ]
    if here is not None:
        args += ["--local-pipeline-stages", str(here)]
    if spec.quantization.value not in {"auto", "none"}:
        args += ["--quantization", spec.quantization.value]
    if ctx.gpu_memory_mib is not None:
        args += ["--gpu-memory-mib", str(ctx.gpu_memory_mib)]
    if ctx.planned_gpu_memory_mib is not None:
        args += ["--planned-gpu-memory-mib", str(ctx.planned_gpu_memory_mib)]
    return args


@dataclass(frozen=True)
class SimEngine:
    """Runs the simulator with the deployment's name and options; used only where ``sim`` was asked for.

    Placed like ``vllm`` on nodes that declare GPUs (``placement.uses_gpus``), it runs as a process all the
    same, wherever its node is: the GPU indices only say which GPUs it holds in the plan.
    """

    kind: EngineKind = EngineKind.SIM
    needs_weights: bool = False
    multi_node: bool = True

    def build(self, ctx: ReplicaContext) -> EngineLaunch:
        argv = [
            ctx.python,
            "-m",
            "controlplane.simulator",
            "--host",
            ctx.host,
            "--port",
            str(ctx.port),
            "--served-model-name",
            ctx.served_model_name,
        ]
        # Only an explicit --max-model-len: catalog defaults (128k …) exceed the simulator's KV size.
        if ctx.spec.max_model_len:
            argv += ["--max-model-len", str(ctx.spec.max_model_len)]
        if ctx.model_dir is not None:
            argv += ["--model", str(ctx.model_dir)]
        if ctx.gpu_ids:
            # What vLLM checks at start-up against its GPUs (controlplane.simulator.gpu); engine args
            # come after, so a rehearsal can shrink the fake GPU (--engine-arg gpu_memory_mib=…).
            argv += _gpu_stand_in_args(ctx)
        # Simulator options (failure injection, latency profile …) pass through as --kebab-case flags.
        for key, value in sorted(ctx.spec.engine_args.items()):
            if key in SARV_ENGINE_ARGS or key == "enable_lora":
                continue
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + key.replace("_", "-"))
            else:
                argv += [flag, str(value)]
        # Adapters are served by name; the simulator has no speculative decoding to configure.
        if ctx.spec.lora_adapters:
            argv += ["--lora-modules", *(a.as_module() for a in ctx.spec.lora_adapters)]
        env = {"SARV_SIM": "1", **lora_env(ctx.spec), **sleep_env(ctx.spec)}
        if ctx.gpu_ids:
            # Placed on GPUs as a stand-in for vllm: the GPUs it was given, as vLLM would see them.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ctx.gpu_ids)
        secret_env = {"VLLM_API_KEY": ctx.api_key} if ctx.api_key is not None else {}
        return EngineLaunch(argv=argv, env=env, secret_env=secret_env, port=ctx.port)
