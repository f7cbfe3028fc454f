"""What a bundle carries is read from the roles and the GPU table, not from a second list."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.bundle.load import _registry_ref
from controlplane.bundle.sources import engine_images, role_packages
from controlplane.fleet.loader import load_fleet

ROOT = Path(__file__).resolve().parents[2]


def test_role_packages_come_from_the_roles() -> None:
    names = role_packages()
    for pkg in ("chrony", "jq", "docker.io", "apparmor", "prometheus", "prometheus-node-exporter"):
        assert pkg in names
    assert {"redis-server", "redis-tools", "xfsprogs", "mdadm", "python3-venv"} <= set(names)


def test_engine_images_follow_the_fleets_gpu_generations() -> None:
    fleet = load_fleet(ROOT / "inventory.example.ini")
    assert engine_images(fleet, "vllm/vllm-openai", None) == ["vllm/vllm-openai:v0.32.0-cu129"]
    assert engine_images(fleet, "registry.site/vllm/vllm-openai", "x@sha256:" + "0" * 64) == [
        "x@sha256:" + "0" * 64
    ]


def test_images_are_renamed_below_the_site_registry() -> None:
    assert _registry_ref("https://reg.site:5000", "nvcr.io/nvidia/k8s/dcgm-exporter:3") == (
        "reg.site:5000/nvidia/k8s/dcgm-exporter:3"
    )
    assert _registry_ref("reg.site", "vllm/vllm-openai:v1") == "reg.site/vllm/vllm-openai:v1"


def test_a_part_recorded_from_other_inputs_is_gathered_again(tmp_path: Path) -> None:
    from controlplane.bundle.create import BundleRequest, _inputs

    a = BundleRequest(output=tmp_path / "b", sign_key=tmp_path / "k", images=["x:1"])
    b = BundleRequest(output=tmp_path / "b", sign_key=tmp_path / "k", images=["x:1"], no_images=True)
    assert _inputs(a, "images") != _inputs(b, "images")
    assert _inputs(a, "debs") == _inputs(b, "debs")


def test_load_never_empties_a_directory_it_did_not_write(tmp_path: Path) -> None:
    from controlplane.bundle.load import _fresh_work
    from controlplane.errors import ConfigError

    precious = tmp_path / "data"
    precious.mkdir()
    (precious / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="is not empty and was not written by `llmctl bundle load`"):
        _fresh_work(precious)
    assert (precious / "keep.txt").is_file()
    work = tmp_path / "work"
    _fresh_work(work)
    (work / "old").write_text("from an earlier load")
    _fresh_work(work)
    assert not (work / "old").exists()


def test_the_dcgm_exporter_image_is_carried_when_the_inventory_pins_it(tmp_path: Path) -> None:
    from controlplane.bundle.sources import role_images

    inv = tmp_path / "hosts.ini"
    inv.write_text("[gpu_nodes]\ng1\n[svc]\ns1\n")
    assert role_images(inv) == (
        [],
        ["dcgm-exporter: dcgm_exporter_image_digest is not set for g1; pass --image REF"],
    )
    digest = "sha256:" + "a" * 64
    inv.write_text(f"[gpu_nodes]\ng1\n[gpu_nodes:vars]\ndcgm_exporter_image_digest={digest}\n")
    assert role_images(inv) == ([f"nvcr.io/nvidia/k8s/dcgm-exporter:3.3.9-3.6.1-ubuntu22.04@{digest}"], [])
