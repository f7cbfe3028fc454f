"""LoRA adapters and draft models are sources: each bad one is refused before anything is copied or started.

The real CLI deploys the tiny model with the ``vllm-cpu`` engine (which needs weights) against its own
home; each refusal must leave no deployment recorded, no weights generated or copied into the model cache
and no replica started.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.vllm import LlmctlEnv

from controlplane.weights import write_manifest
from controlplane.weights.tiny import generate_tiny_model


def _adapter(path: Path, *, rank: int = 8, manifest: bool = True) -> Path:
    path.mkdir(parents=True)
    cfg = {"r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    if manifest:
        write_manifest(path)
    return path


def _refused(env: LlmctlEnv, *args: str) -> str:
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "vllm-cpu", *args)
    assert out.returncode == 6, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert env.status()["deployments"] == []
    # Nothing generated, copied or started: no model cache entry, no replica directory.
    home_files = [p.relative_to(env.home).as_posix() for p in env.home.rglob("*") if p.is_file()]
    assert not [f for f in home_files if "sarv-tiny" in f or f.startswith("replicas")], home_files
    return lines[0]


@pytest.fixture
def env(tmp_path: Path) -> LlmctlEnv:
    return LlmctlEnv.create(tmp_path / "home")


def test_a_missing_adapter_directory_is_refused_naming_it(env: LlmctlEnv, tmp_path: Path) -> None:
    line = _refused(env, "--lora-module", f"sql={tmp_path / 'nowhere'}")
    assert "LoRA adapter 'sql'" in line and "is not a directory" in line


def test_an_adapter_without_a_manifest_is_refused(env: LlmctlEnv, tmp_path: Path) -> None:
    src = _adapter(tmp_path / "sql", manifest=False)
    line = _refused(env, "--lora-module", f"sql={src}")
    assert "LoRA adapter 'sql'" in line and "SHA256SUMS" in line


def test_an_adapter_that_does_not_match_its_manifest_is_refused(env: LlmctlEnv, tmp_path: Path) -> None:
    src = _adapter(tmp_path / "sql")
    (src / "adapter_model.safetensors").write_bytes(b"tampered")
    line = _refused(env, "--lora-module", f"sql={src}")
    assert "LoRA adapter 'sql'" in line and "does not match the manifest" in line


def test_an_adapter_above_max_lora_rank_is_refused(env: LlmctlEnv, tmp_path: Path) -> None:
    src = _adapter(tmp_path / "sql", rank=32)
    line = _refused(env, "--lora-module", f"sql={src}")
    assert "rank 32, above max_lora_rank 16" in line and "max_lora_rank=32" in line
    line = _refused(env, "--lora-module", f"sql={src}", "--engine-arg", "max_lora_rank=16")
    assert "rank 32, above max_lora_rank 16" in line


def test_a_missing_draft_model_is_refused(env: LlmctlEnv, tmp_path: Path) -> None:
    line = _refused(env, "--speculative-config", f"draft:{tmp_path / 'no-draft'}:3")
    assert "draft model" in line and "is not a directory" in line


def test_an_unverifiable_draft_model_is_refused(env: LlmctlEnv, tmp_path: Path) -> None:
    draft = generate_tiny_model(tmp_path / "draft")
    (draft / "SHA256SUMS").unlink()
    line = _refused(env, "--speculative-config", f"draft:{draft}")
    assert "draft model" in line and "SHA256SUMS" in line


def test_a_good_adapter_passes_the_checks() -> None:
    import tempfile

    from controlplane.weights.adapters import check_adapter_source

    with tempfile.TemporaryDirectory() as d:
        assert check_adapter_source("sql", str(_adapter(Path(d) / "sql", rank=8))) == 8
        assert check_adapter_source("sql", str(Path(d) / "sql"), max_lora_rank=8) == 8
