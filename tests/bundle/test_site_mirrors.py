"""llmctl honours the mirrors the common role records in /etc/sarv/mirrors.env: model store and registry."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from controlplane.catalog import Catalog
from controlplane.controller.deploy import Deployer
from controlplane.settings import load_settings
from controlplane.spec import DeploymentSpec, EngineKind, Quantization


@pytest.fixture
def mirrors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "mirrors.env"
    # As roles/common/templates/mirrors.env.j2 writes it, plus a key Settings does not know (the engines').
    path.write_text(
        "# Ansible managed\nSARV_PYPI_INDEX_URL=\nSARV_REGISTRY_MIRROR=https://registry.site:5000\n"
        "SARV_MODEL_STORE_URL=http://10.0.0.5:8765/models\nSARV_FOR_ENGINES_ONLY=1\n"
    )
    monkeypatch.setenv("SARV_MIRRORS_ENV", str(path))
    return path


def test_settings_read_the_roles_mirrors_below_environment(
    mirrors: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = load_settings()
    assert s.model_store_url == "http://10.0.0.5:8765/models"
    assert s.resolved_vllm_image_repository == "registry.site:5000/vllm/vllm-openai"
    monkeypatch.setenv("SARV_MODEL_STORE_URL", "http://elsewhere/models")
    assert load_settings().model_store_url == "http://elsewhere/models"


def test_deploy_takes_weights_without_a_source_from_the_model_store(mirrors: Path) -> None:
    model = Catalog.load().entry("llama-3-8b")
    spec = DeploymentSpec(name="d", model=model.name, engine=EngineKind.VLLM)
    fake = SimpleNamespace(settings=load_settings())
    source = Deployer._model_source(fake, spec, model, Quantization.FP8)  # type: ignore[arg-type]
    assert source == f"http://10.0.0.5:8765/models/{model.name}/fp8"
    # An explicit source still wins.
    spec = DeploymentSpec(name="d", model=model.name, engine=EngineKind.VLLM, source="/srv/w")
    assert Deployer._model_source(fake, spec, model, Quantization.FP8) == "/srv/w"  # type: ignore[arg-type]
