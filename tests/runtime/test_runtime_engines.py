"""Engine adapters build exactly the commands the engines expect (the docker argv cannot run here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import SecretStr

from controlplane.engines.base import ReplicaContext, check_engine_args
from controlplane.engines.sim import SimEngine
from controlplane.engines.vllm import VllmEngine
from controlplane.engines.vllm_cpu import VllmCpuEngine, omp_threads_bind
from controlplane.errors import LaunchError, UserError
from controlplane.spec import (
    DeploymentSpec,
    EngineKind,
    LoraAdapter,
    ProbePaths,
    Quantization,
    Shard,
    SpeculativeConfig,
)


def _ctx(**spec_kw: object) -> ReplicaContext:
    spec_kw.setdefault("engine", EngineKind.VLLM)
    spec = DeploymentSpec(name="llama", model="llama-70b", **spec_kw)  # type: ignore[arg-type]
    return ReplicaContext(
        replica_id="llama-0",
        spec=spec,
        served_model_name="llama",
        model_dir=Path("/srv/models/llama-70b/abcd"),
        host="10.0.0.5",
        port=8101,
        shards=[Shard(node="gpu-a1", gpus=[0, 1], pp_rank=0)],
        gpu_ids=["GPU-aaa", "GPU-bbb"],
        env_file=Path("/run/sarv/llama-0.env"),
        max_model_len=8192,
    )


def test_vllm_container_argv_is_exact_and_hardened() -> None:
    launch = VllmEngine(image="vllm/vllm-openai:v0.11.0").build(_ctx(tp=2))
    assert launch.argv == [
        "docker", "run", "--detach", "--name", "sarv-llama-0",
        "--label", "sarv.replica=llama-0", "--label", "sarv.deployment=llama",
        "--gpus", '"device=GPU-aaa,GPU-bbb"',
        "--security-opt", "no-new-privileges:true",
        "--security-opt", "label=type:container_t",
        "--restart", "on-failure:5",
        "--pids-limit", "4096",
        "--log-opt", "max-size=100m", "--log-opt", "max-file=3",
        "--shm-size", "16g",
        "--volume", "/srv/models/llama-70b/abcd:/models/llama-70b:ro,z",
        "--publish", "10.0.0.5:8101:8000",
        "--env", "HF_HUB_OFFLINE=1", "--env", "VLLM_NO_USAGE_STATS=1", "--env", "DO_NOT_TRACK=1",
        "--entrypoint", "python3", "vllm/vllm-openai:v0.11.0", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/models/llama-70b", "--served-model-name", "llama",
        "--host", "0.0.0.0", "--port", "8000",
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
        "--dtype", "bfloat16", "--max-model-len", "8192",
        "--gpu-memory-utilization", "0.9",
    ]  # fmt: skip
    assert "--privileged" not in launch.argv
    assert launch.container_name == "sarv-llama-0"


def test_vllm_api_key_travels_by_name_never_in_argv() -> None:
    ctx = _ctx(tp=2).model_copy(update={"api_key": SecretStr("sk-secret-123")})
    launch = VllmEngine(image="img:1").build(ctx)
    assert not any("sk-secret-123" in a for a in launch.argv)
    assert "--api-key" not in launch.argv
    i = launch.argv.index("VLLM_API_KEY")
    assert launch.argv[i - 1] == "--env" and launch.argv.index(launch.container_name or "") < i
    assert launch.secret_env["VLLM_API_KEY"].get_secret_value() == "sk-secret-123"
    assert "sk-secret-123" not in repr(launch)


def test_vllm_engine_options_map_to_flags() -> None:
    ctx = _ctx(
        tp=2,
        quantization=Quantization.AWQ,
        kv_cache_dtype="fp8",
        engine_args={
            "max_num_seqs": 64,
            "max_num_batched_tokens": 8192,
            "enable_prefix_caching": True,
            "lora_modules": "sql=/srv/lora/sql,chat=/srv/lora/chat",
            "speculative_config": "ngram:5",
            "enforce_eager": False,
        },
    )
    argv = VllmEngine(image="img:1", selinux_type="nvidia_container_t", memory="200g").build(ctx).argv
    tail = argv[argv.index("vllm.entrypoints.openai.api_server") + 1 :]
    assert tail[tail.index("--quantization") + 1] == "awq"
    assert tail[tail.index("--kv-cache-dtype") + 1] == "fp8"
    assert tail[tail.index("--max-num-seqs") + 1] == "64"
    assert tail[tail.index("--max-num-batched-tokens") + 1] == "8192"
    assert "--enable-prefix-caching" in tail
    assert "--no-enforce-eager" in tail
    i = tail.index("--lora-modules")
    assert tail[i - 1] == "--enable-lora"
    assert tail[i + 1 : i + 3] == ["sql=/srv/lora/sql", "chat=/srv/lora/chat"]
    spec = json.loads(tail[tail.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    assert "label=type:nvidia_container_t" in argv
    assert argv[argv.index("--memory") + 1] == "200g"


def test_speculative_draft_model() -> None:
    argv = VllmEngine(image="i").build(_ctx(tp=2, engine_args={"speculative_config": "draft:/m/d:3"})).argv
    cfg = json.loads(argv[argv.index("--speculative-config") + 1])
    assert cfg == {"model": "/m/d", "num_speculative_tokens": 3}


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ({"api_key": "x"}, "api_key"),
        ({"tensor_parallel_size": 2}, "--tp"),
        ({"lora_modules": "no-path"}, "NAME=PATH"),
        ({"speculative_config": "{oops"}, "JSON"),
        ({"speculative_config": "magic"}, "not understood"),
    ],
)
def test_bad_engine_options_are_user_errors(args: dict[str, str | int], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        check_engine_args(DeploymentSpec(name="x", model="m", engine_args=args))


def test_vllm_refuses_a_multi_node_replica_whose_shards_miss_gpus() -> None:
    ctx = _ctx(tp=1, pp=2).model_copy(
        update={"shards": [Shard(node="a", gpus=[0], pp_rank=0), Shard(node="b", gpus=[], pp_rank=1)]}
    )
    with pytest.raises(LaunchError, match="1 GPUs planned for tp×pp = 2 over nodes a, b"):
        VllmEngine(image="i").build(ctx)


def test_vllm_refuses_gpu_count_not_matching_tp() -> None:
    with pytest.raises(LaunchError, match="2 GPUs planned for tp×pp = 4"):
        VllmEngine(image="i").build(_ctx(tp=4))


def test_vllm_cpu_process_command() -> None:
    ctx = _ctx(engine=EngineKind.VLLM_CPU).model_copy(
        update={"host": "127.0.0.1", "python": "/venv/bin/python", "api_key": SecretStr("k1")}
    )
    launch = VllmCpuEngine().build(ctx)
    assert launch.argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert launch.argv[launch.argv.index("--model") + 1] == "/srv/models/llama-70b/abcd"
    assert launch.argv[launch.argv.index("--host") + 1] == "127.0.0.1"
    assert launch.env["HF_HUB_OFFLINE"] == "1"
    assert launch.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in launch.env
    assert "k1" not in " ".join(launch.argv)
    assert launch.secret_env["VLLM_API_KEY"].get_secret_value() == "k1"


def test_vllm_cpu_binds_worker_threads_for_pipeline_parallelism() -> None:
    assert omp_threads_bind(2, 2) == "0|1"
    assert omp_threads_bind(2, 8) == "0-3|4-7"
    with pytest.raises(LaunchError, match="need at least 3 cores"):
        omp_threads_bind(3, 2)
    launch = VllmCpuEngine().build(_ctx(engine=EngineKind.VLLM_CPU, engine_args={"omp_threads_bind": "0|1"}))
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "--omp-threads-bind" not in launch.argv


def test_sim_command_passes_simulator_options() -> None:
    ctx = _ctx(
        engine=EngineKind.SIM,
        engine_args={"slow_start_s": 2.5, "lora_modules": "a1,a2", "enable_prefix_caching": False},
    ).model_copy(update={"host": "127.0.0.1", "model_dir": None})
    launch = SimEngine().build(ctx)
    assert launch.argv[1:3] == ["-m", "controlplane.simulator"]
    assert launch.argv[launch.argv.index("--served-model-name") + 1] == "llama"
    assert launch.argv[launch.argv.index("--slow-start-s") + 1] == "2.5"
    i = launch.argv.index("--lora-modules")
    assert launch.argv[i + 1 : i + 3] == ["a1", "a2"]
    assert "--no-enable-prefix-caching" in launch.argv
    assert SimEngine().needs_weights is False


def test_typed_adapters_and_speculative_config_build_the_vllm_flags() -> None:
    ctx = _ctx(
        tp=2,
        lora_adapters=[LoraAdapter(name="sql", source="/srv/lora/sql")],
        speculative=SpeculativeConfig(
            method="eagle",
            model="/m/eagle",
            num_speculative_tokens=2,
            options={"draft_tensor_parallel_size": 1},
        ),
    )
    argv = VllmEngine(image="i").build(ctx).argv
    i = argv.index("--lora-modules")
    assert argv[i - 1 : i + 2] == ["--enable-lora", "--lora-modules", "sql=/srv/lora/sql"]
    cfg = json.loads(argv[argv.index("--speculative-config") + 1])
    assert cfg == {
        "method": "eagle",
        "model": "/m/eagle",
        "num_speculative_tokens": 2,
        "draft_tensor_parallel_size": 1,
    }


def test_engine_arg_forms_become_typed_fields_once() -> None:
    spec = DeploymentSpec(
        name="x",
        model="m",
        engine_args={
            "lora_modules": "sql=/srv/lora/sql, chat",
            "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}',
            "max_num_seqs": 8,
        },
    )
    assert spec.engine_args == {"max_num_seqs": 8}
    assert spec.lora_adapters == [LoraAdapter(name="sql", source="/srv/lora/sql"), LoraAdapter(name="chat")]
    assert spec.speculative == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, options={"prompt_lookup_min": 2}
    )
    # A stored record reads back as the same spec, so a repeated deploy is not a conflict.
    assert DeploymentSpec.model_validate(spec.model_dump(mode="json")) == spec


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"engine_args": {"lora_modules": "a=/p"}, "lora_adapters": [{"name": "b"}]}, "given twice"),
        ({"engine_args": {"lora_modules": "a=/p,a=/q"}}, "'a' is given twice"),
        ({"engine_args": {"lora_modules": "a="}}, "NAME=PATH"),
        ({"engine_args": {"speculative_config": "ngram:x"}}, "not understood"),
        ({"engine_args": {"speculative_config": '{"num_speculative_tokens": 0, "method": "x"}'}}, "greater"),
        ({"engine_args": {"speculative_config": '{"num_speculative_tokens": 2}'}}, "method or a draft model"),
    ],
)
def test_malformed_typed_engine_options_are_one_line_user_errors(
    kwargs: dict[str, object], needle: str
) -> None:
    with pytest.raises(UserError, match=needle) as err:
        DeploymentSpec(name="x", model="m", **kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_vllm_refuses_an_adapter_without_weights_but_sim_serves_it_by_name() -> None:
    adapters = [LoraAdapter(name="a1")]
    with pytest.raises(UserError, match="'a1' has no weights"):
        check_engine_args(DeploymentSpec(name="x", model="m", lora_adapters=adapters))
    check_engine_args(DeploymentSpec(name="x", model="m", engine=EngineKind.SIM, lora_adapters=adapters))


def test_engines_declare_their_probe_paths() -> None:
    sim = SimEngine().build(_ctx(engine=EngineKind.SIM).model_copy(update={"model_dir": None}))
    gpu = VllmEngine(image="i").build(_ctx(tp=2))
    assert sim.probes == gpu.probes == ProbePaths(health="/health", ready="/v1/models", metrics="/metrics")
