"""The simulator standing in for a GPU engine refuses to start where vLLM would: too few visible GPUs for
tp × pp, a plan larger than its fake GPU, weights of another variant; ``llmctl deploy`` reports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.fleets import gpu_fleet, llmctl_on_fleet
from fixtures.vllm import LlmctlEnv

from controlplane.simulator.cli import parse_config
from controlplane.simulator.gpu import GpuCheckError, check_gpu_stand_in


def _check(args: list[str], visible: str | None = None) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    check_gpu_stand_in(parse_config(args), env)


def test_too_few_visible_gpus_for_tp_times_pp_are_refused_like_vllm() -> None:
    _check(["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"], "0,1,2,3")
    with pytest.raises(GpuCheckError, match=r"= 4\) is larger than the number of available GPUs \(2"):
        _check(["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"], "0,1")
    # Without CUDA_VISIBLE_DEVICES the simulator is not standing in for a GPU engine: nothing to check.
    _check(["--tensor-parallel-size", "8"])


def test_pp_across_nodes_counts_the_gpus_of_this_node_only() -> None:
    two_nodes = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    _check([*two_nodes, "--local-pipeline-stages", "1"], "GPU-a,GPU-b")
    with pytest.raises(GpuCheckError, match=r"2 tensor parallel × 2 pipeline = 4\) is larger"):
        _check([*two_nodes, "--local-pipeline-stages", "2"], "GPU-a,GPU-b")


def test_a_plan_larger_than_the_fake_gpu_is_refused() -> None:
    gpu = ["--gpu-memory-mib", "81920", "--gpu-memory-utilization", "0.9"]
    _check([*gpu, "--planned-gpu-memory-mib", "73728"], "0")
    with pytest.raises(GpuCheckError, match=r"Free memory on device \(81920 MiB total\).*73729 MiB"):
        _check([*gpu, "--planned-gpu-memory-mib", "73729"], "0")


def _weights(tmp_path: Path, config: dict[str, object]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_weights_of_another_variant_are_refused(tmp_path: Path) -> None:
    awq = _weights(tmp_path, {"torch_dtype": "float16", "quantization_config": {"quant_method": "awq"}})
    _check(["--model", awq, "--quantization", "awq", "--dtype", "float16"])
    with pytest.raises(GpuCheckError, match=r"model config \(awq\) does not match .* argument \(fp8\)"):
        _check(["--model", awq, "--quantization", "fp8"])
    with pytest.raises(GpuCheckError, match=r"quantized \(awq\) but no quantization was requested"):
        _check(["--model", awq])
    (tmp_path / "bf16").mkdir()
    bf16 = _weights(tmp_path / "bf16", {"torch_dtype": "bfloat16"})
    _check(["--model", bf16, "--dtype", "bfloat16"])
    _check(["--model", bf16, "--dtype", "float16"])  # vLLM casts unquantized weights, warning only
    with pytest.raises(GpuCheckError, match=r"model config \(none\) does not match .* argument \(int8\)"):
        _check(["--model", bf16, "--quantization", "int8"])


def test_the_simulator_process_exits_before_listening_with_vllms_message() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "controlplane.simulator", "--port", "0", "--tensor-parallel-size", "2"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert "ValueError: World size on this node (2 tensor parallel × 1 pipeline = 2)" in proc.stderr


@pytest.fixture
def gpu_host(tmp_path: Path) -> Iterator[LlmctlEnv]:
    """``llmctl`` whose fleet is this host, declared with two A100s; whatever is left is undeployed."""
    with llmctl_on_fleet(tmp_path, gpu_fleet(gpus=2, names=["localhost"])) as e:
        yield e


@pytest.mark.parametrize(
    ("engine_arg", "reason"),
    [
        # A fake GPU smaller than the fleet declares: the plan no longer fits it.
        ("gpu_memory_mib=64", "Free memory on device (64 MiB total) is less than the planned"),
        # Both pipeline stages claimed on this node, which holds only the tp GPUs of one.
        (
            "local_pipeline_stages=2",
            "is larger than the number of available GPUs (2, CUDA_VISIBLE_DEVICES=0,1)",
        ),
    ],
)
def test_llmctl_deploy_reports_the_stand_ins_refusal_and_rolls_back(
    gpu_host: LlmctlEnv, engine_arg: str, reason: str
) -> None:
    out = gpu_host.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--tp", "2", "--engine-arg", engine_arg)
    assert out.returncode == 6, out.stderr
    assert "exited with code 1 during start-up" in out.stderr
    assert reason in out.stderr
    assert gpu_host.status()["deployments"] == []


def test_llmctl_deploy_gives_the_stand_in_the_plan_and_the_gpus(gpu_host: LlmctlEnv) -> None:
    gpu_host.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--tp", "2", check=True)
    [dep] = gpu_host.status()["deployments"]
    [replica] = dep["replicas"]
    assert replica["state"] == "ready"
    argv = Path(f"/proc/{replica['pid']}/cmdline").read_bytes().decode().split("\0")
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--gpu-memory-mib") + 1] == "81920"
    assert int(argv[argv.index("--planned-gpu-memory-mib") + 1]) > 0
