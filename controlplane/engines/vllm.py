"""The ``vllm`` engine: vLLM's OpenAI server in a hardened container on a GPU node."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from controlplane.engines.base import EngineLaunch, ReplicaContext, lora_env, vllm_server_args
from controlplane.errors import LaunchError
from controlplane.spec import EngineKind

__all__ = ["VllmEngine"]

_CONTAINER_PORT = 8000
_MODEL_MOUNT = PurePosixPath("/models")


@dataclass(frozen=True)
class VllmEngine:
    """Builds the ``docker run`` argv for one replica (the launcher runs it on the node).

    Hardening: no ``--privileged``, an SELinux type label, ``no-new-privileges``, weights mounted
    read-only, a restart policy and resource limits; the API key reaches the container through a 0600
    env file, so it never appears in ``ps`` or ``docker inspect``'s command line.
    """

    image: str | None = None
    """Fallback image when the replica's context names none (deploy picks one per GPU generation)."""
    selinux_type: str = "container_t"
    """``container_t``, or the NVIDIA container policy's type (``nvidia_container_t``) where installed."""
    restart: str = "on-failure:5"
    shm_size: str = "16g"
    """vLLM's workers exchange tensors through /dev/shm; a private segment instead of ``--ipc=host``."""
    pids_limit: int = 4096
    memory: str | None = None
    """Container memory limit (``--memory``), e.g. ``200g``; None leaves the host's."""
    cpus: float | None = None
    docker: str = "docker"

    kind: EngineKind = EngineKind.VLLM
    needs_weights: bool = True
    multi_node: bool = False
    """The Ray cluster of a multi-node replica would have to run inside the containers; not built yet."""

    def build(self, ctx: ReplicaContext) -> EngineLaunch:
        nodes = {s.node for s in ctx.shards}
        if len(nodes) > 1:
            # Pipeline stages on several nodes run as one Ray cluster; that is a launcher's job.
            raise LaunchError(
                f"replica {ctx.replica_id} spans nodes {', '.join(sorted(nodes))}",
                hint="the vllm engine runs each replica on one node; see docs/runtime.md",
            )
        if ctx.model_dir is None:
            raise LaunchError(f"replica {ctx.replica_id}: no verified weights directory to mount")
        if not ctx.gpu_ids:
            raise LaunchError(f"replica {ctx.replica_id}: the plan gives it no GPUs")
        image = ctx.image or self.image
        if not image:
            raise LaunchError(f"replica {ctx.replica_id}: no engine image (set vllm_image)")
        rp = ctx.replica
        tp_pp = rp.tp * rp.pp if rp is not None else ctx.spec.tp * (ctx.spec.pp or 1)
        if len(ctx.gpu_ids) != tp_pp:
            raise LaunchError(
                f"replica {ctx.replica_id}: {len(ctx.gpu_ids)} GPUs planned for tp×pp = {tp_pp}"
            )
        name = f"sarv-{ctx.replica_id}"
        mount = _MODEL_MOUNT / ctx.spec.model
        secret_env = {}
        if ctx.api_key is not None:
            if ctx.env_file is None:
                raise LaunchError(f"replica {ctx.replica_id}: an API key needs an env file to travel in")
            secret_env["VLLM_API_KEY"] = ctx.api_key
        argv = [
            self.docker,
            "run",
            "--detach",
            "--name",
            name,
            "--label",
            f"sarv.replica={ctx.replica_id}",
            "--label",
            f"sarv.deployment={ctx.spec.name}",
            # The csv parser of --gpus splits on commas unless the value is quoted.
            "--gpus",
            '"device=' + ",".join(ctx.gpu_ids) + '"',
            "--security-opt",
            "no-new-privileges:true",
            "--security-opt",
            f"label=type:{self.selinux_type}",
            "--restart",
            self.restart,
            "--shm-size",
            self.shm_size,
            "--pids-limit",
            str(self.pids_limit),
            "--log-opt",
            "max-size=100m",
            "--log-opt",
            "max-file=3",
        ]
        if self.memory:
            argv += ["--memory", self.memory]
        if self.cpus:
            argv += ["--cpus", str(self.cpus)]
        # ro: engines never write weights; z: a shared SELinux label, since replicas share the cache.
        argv += [
            "--volume",
            f"{ctx.model_dir}:{mount}:ro,z",
            *_source_mounts(ctx),
            "--publish",
            f"{ctx.host}:{ctx.port}:{_CONTAINER_PORT}",
            "--env",
            "HF_HUB_OFFLINE=1",
            "--env",
            "VLLM_NO_USAGE_STATS=1",
            "--env",
            "DO_NOT_TRACK=1",
        ]
        for key, value in lora_env(ctx.spec).items():
            argv += ["--env", f"{key}={value}"]
        if ctx.env_file is not None and secret_env:
            argv += ["--env-file", str(ctx.env_file)]
        # An explicit entrypoint: images switched from the module to `vllm serve` across versions.
        argv += ["--entrypoint", "python3", image, "-m", "vllm.entrypoints.openai.api_server"]
        argv += vllm_server_args(ctx, model_path=str(mount), host="0.0.0.0", port=_CONTAINER_PORT)  # noqa: S104
        # GPU only: the CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE instead.
        argv += ["--gpu-memory-utilization", str(ctx.spec.gpu_memory_utilization)]
        return EngineLaunch(argv=argv, secret_env=secret_env, port=ctx.port, container_name=name)


def _source_mounts(ctx: ReplicaContext) -> list[str]:
    """LoRA adapters and the draft model, read-only at the same path inside the container as on the node."""
    paths = [a.source for a in ctx.spec.lora_adapters if a.source is not None]
    if ctx.spec.speculative is not None and ctx.spec.speculative.model is not None:
        paths.append(ctx.spec.speculative.model)
    out: list[str] = []
    for path in dict.fromkeys(paths):
        out += ["--volume", f"{path}:{path}:ro,z"]
    return out
