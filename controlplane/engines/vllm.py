"""The ``vllm`` engine: vLLM's OpenAI server in a hardened container on a GPU node."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from controlplane.engines.base import EngineLaunch, ReplicaContext, lora_env, sleep_env, vllm_server_args
from controlplane.errors import LaunchError
from controlplane.spec import EngineKind

__all__ = ["VllmEngine"]

_CONTAINER_PORT = 8000
_MODEL_MOUNT = PurePosixPath("/models")
_RAY_SESSION = "/tmp/ray"  # noqa: S108 - inside the member container: Ray's session directory


@dataclass(frozen=True)
class VllmEngine:
    """Builds the ``docker run`` argv for one replica (the launcher runs it on the node).

    Hardening: no ``--privileged``, an SELinux type label, ``no-new-privileges``, weights mounted
    read-only, a restart policy and resource limits; the API key reaches the container through a 0600
    EnvironmentFile (or the launcher's process environment) passed on by name (``--env VLLM_API_KEY``), so
    it never appears in ``ps`` or ``docker inspect``'s command line.
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
    multi_node: bool = True
    """Pipeline stages on several nodes: a Ray cluster of containers of the same image, one per node."""

    def build(self, ctx: ReplicaContext) -> EngineLaunch:
        image, multi = self._checked(ctx)
        name = f"sarv-{ctx.replica_id}"
        mount = _MODEL_MOUNT / ctx.spec.model
        secret_env = {}
        if ctx.api_key is not None:
            # `--env NAME` without a value: docker copies it from its own environment into the
            # container, where the launcher put it (a 0600 EnvironmentFile for units over SSH, the
            # process environment locally); the value is never on a command line.
            secret_env["VLLM_API_KEY"] = ctx.api_key
        env = {
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **lora_env(ctx.spec),
            **sleep_env(ctx.spec),
        }
        argv = [self.docker, "run", "--detach", "--name", name, *self._labels(ctx)]
        if multi:
            # The server is the Ray driver of the replica's own cluster: it shares the head member's
            # host network, shared memory (Ray's object store) and /tmp/ray (session sockets). The
            # members hold the GPUs; the driver needs none. It listens on the node's private address.
            head = _member_name(ctx.replica_id, "ray-head")
            argv += ["--network", "host", "--ipc", f"container:{head}", "--volumes-from", head]
            argv += self._hardening()
            argv += ["--volume", f"{ctx.model_dir}:{mount}:ro,z", *_source_mounts(ctx)]
        else:
            argv += [
                # The csv parser of --gpus splits on commas unless the value is quoted.
                "--gpus",
                '"device=' + ",".join(ctx.gpu_ids) + '"',
                *self._hardening(),
                "--shm-size",
                self.shm_size,
                # ro: engines never write weights; z: a shared SELinux label, replicas share the cache.
                "--volume",
                f"{ctx.model_dir}:{mount}:ro,z",
                *_source_mounts(ctx),
                "--publish",
                f"{ctx.host}:{ctx.port}:{_CONTAINER_PORT}",
            ]
        for key, value in env.items():
            argv += ["--env", f"{key}={value}"]
        for key in sorted(secret_env):
            argv += ["--env", key]
        # An explicit entrypoint: images switched from the module to `vllm serve` across versions.
        argv += ["--entrypoint", "python3", image, "-m", "vllm.entrypoints.openai.api_server"]
        host, port = (ctx.host, ctx.port) if multi else ("0.0.0.0", _CONTAINER_PORT)  # noqa: S104
        argv += vllm_server_args(ctx, model_path=str(mount), host=host, port=port)
        if multi:
            argv += ["--distributed-executor-backend", "ray"]
        # GPU only: the CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE instead.
        argv += ["--gpu-memory-utilization", str(ctx.spec.gpu_memory_utilization)]
        member = self._member_argv(ctx, image, str(mount), env) if multi else []
        return EngineLaunch(
            argv=argv,
            secret_env=secret_env,
            port=ctx.port,
            container_name=name,
            ray_member_argv=member,
        )

    def _checked(self, ctx: ReplicaContext) -> tuple[str, bool]:
        """The image, and whether the replica spans nodes; refuses a context the engine cannot run."""
        if ctx.model_dir is None:
            raise LaunchError(f"replica {ctx.replica_id}: no verified weights directory to mount")
        if not ctx.gpu_ids:
            raise LaunchError(f"replica {ctx.replica_id}: the plan gives it no GPUs")
        image = ctx.image or self.image
        if not image:
            raise LaunchError(f"replica {ctx.replica_id}: no engine image (set vllm_image)")
        rp = ctx.replica
        tp, pp = (rp.tp, rp.pp) if rp is not None else (ctx.spec.tp, ctx.spec.pp or 1)
        nodes = list(dict.fromkeys(s.node for s in sorted(ctx.shards, key=lambda s: s.pp_rank)))
        multi = len(nodes) > 1
        # Multi-node: the stages' GPUs are the Ray members' (stage_gpus); the head's shows in gpu_ids.
        planned = sum(len(s.gpus) for s in ctx.shards) if multi else len(ctx.gpu_ids)
        if planned != tp * pp:
            over = f" over nodes {', '.join(nodes)}" if multi else ""
            raise LaunchError(f"replica {ctx.replica_id}: {planned} GPUs planned for tp×pp = {tp * pp}{over}")
        return image, multi

    def _member_argv(self, ctx: ReplicaContext, image: str, mount: str, env: dict[str, str]) -> list[str]:
        """``docker run`` of one Ray member up to the image; ``{name}``/``{gpus}`` filled per node."""
        return [
            self.docker,
            "run",
            "--detach",
            "--name",
            "{name}",
            *self._labels(ctx),
            "--network",
            "host",
            "--gpus",
            '"device={gpus}"',
            *self._hardening(),
            "--shm-size",
            self.shm_size,
            # The driver joins the head member's IPC namespace (Ray's object store in /dev/shm); Docker
            # refuses to join a container's IPC unless that container made it shareable.
            "--ipc",
            "shareable",
            # An anonymous volume for the member's Ray session, which the driver container mounts
            # with --volumes-from (its sockets live there).
            "--volume",
            _RAY_SESSION,
            "--volume",
            f"{ctx.model_dir}:{mount}:ro,z",
            *_source_mounts(ctx),
            *[a for key, value in env.items() for a in ("--env", f"{key}={value}")],
            "--entrypoint",
            "ray",
            image,
        ]

    def _labels(self, ctx: ReplicaContext) -> list[str]:
        return ["--label", f"sarv.replica={ctx.replica_id}", "--label", f"sarv.deployment={ctx.spec.name}"]

    def _hardening(self) -> list[str]:
        out = [
            "--security-opt",
            "no-new-privileges:true",
            "--security-opt",
            f"label=type:{self.selinux_type}",
            "--restart",
            self.restart,
            "--pids-limit",
            str(self.pids_limit),
            "--log-opt",
            "max-size=100m",
            "--log-opt",
            "max-file=3",
        ]
        if self.memory:
            out += ["--memory", self.memory]
        if self.cpus:
            out += ["--cpus", str(self.cpus)]
        return out


def _member_name(replica_id: str, role: str) -> str:
    """The container of one Ray member: the name of its systemd unit (``sarv-<replica>-<role>``)."""
    return f"sarv-{replica_id}-{role}"


def _source_mounts(ctx: ReplicaContext) -> list[str]:
    """LoRA adapters and the draft model, read-only at the same path inside the container as on the node."""
    paths = [a.source for a in ctx.spec.lora_adapters if a.source is not None]
    if ctx.spec.speculative is not None and ctx.spec.speculative.model is not None:
        paths.append(ctx.spec.speculative.model)
    out: list[str] = []
    for path in dict.fromkeys(paths):
        out += ["--volume", f"{path}:{path}:ro,z"]
    return out
