"""`llmctl bundle create | verify`: real wheels, .debs, a locally built image and the tiny model, signed with
ssh-keygen; tampering, a foreign signature, an interrupted run and an incremental bundle."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from fixtures.bundles import Kit, llmctl

from controlplane.bundle.manifest import MANIFEST, Manifest, open_bundle

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_bundle_holds_every_part_with_hashes_and_verifies(kit: Kit, built: Path) -> None:
    manifest, _, _ = open_bundle(built)
    parts = {f.part for f in manifest.files}
    assert parts == {"wheels", "debs", "images", "models", "dashboards"}
    names = {Path(f.path).name for f in manifest.files}
    assert {"sarvtest_a-1.0-py3-none-any.whl", "sarvtest_b-2.0-py3-none-any.whl"} <= names
    assert any(n.startswith("sarv-0.1.0-") and n.endswith(".whl") for n in names)  # Sarv itself
    assert any(n.startswith("python3.11-venv_") for n in names)
    assert {"InRelease", "Release.gpg", "Packages", "sarv-bundle.asc"} <= names
    assert kit.image in manifest.parts["images"]
    assert manifest.parts["images"][kit.image].startswith("sha256:")
    assert "models/sarv-tiny/none/SHA256SUMS" in {f.path for f in manifest.files}
    assert "terraform" in manifest.parts and "left_out" in manifest.parts["terraform"]

    res = llmctl("bundle", "verify", str(built), "--allowed-signers", str(kit.allowed_signers))
    assert res.returncode == 0, res.stderr
    assert f"signature good, {len(manifest.files)} files verified" in res.stdout


def test_create_prints_the_plan_and_part_sizes_and_resumes(kit: Kit, tmp_path: Path) -> None:
    out = tmp_path / "resume.bundle"
    first = kit.create(out, "--weights", "broken/none=/nonexistent/weights")
    assert first.returncode == 6, first.stderr
    assert "/nonexistent/weights is not a directory" in first.stderr
    assert "plan: debs:" in first.stderr and "plan: images: 1 images" in first.stderr
    assert not out.exists()

    second = kit.create(out)
    assert second.returncode == 0, second.stderr
    for part in ("wheels", "debs", "images"):
        assert f"{part}: already gathered and verified, skipped" in second.stderr
    assert "size: models:" in second.stderr and "size: wheels: 3 files" in second.stderr
    assert not out.with_name(out.name + ".work").exists()


def test_an_engine_image_missing_here_is_named_with_what_to_do(kit: Kit, tmp_path: Path) -> None:
    env = {**kit.env, "SARV_VLLM_IMAGE": ""}
    res = llmctl(
        "bundle", "create", "-i", str(kit.inventory), "-o", str(tmp_path / "x.bundle"),
        "--sign-key", str(kit.sign_key), "--packages", "none", "--lock", str(kit.lock),
        "--find-links", str(kit.wheels), env=env,
    )  # fmt: skip
    assert res.returncode == 8
    assert "image(s) not in this machine's Docker: vllm/vllm-openai:v0.32.0-cu129" in res.stderr
    assert "docker pull" in res.stderr and "--no-images" in res.stderr
    assert "Traceback" not in res.stderr


def _flip_byte(bundle: Path, member_name: str) -> None:
    with tarfile.open(bundle, "r:") as tar:
        offset = tar.getmember(member_name).offset_data
    with bundle.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_tampered_file_is_named_with_both_hashes_by_verify_and_load(
    kit: Kit, built: Path, tmp_path: Path
) -> None:
    bad = tmp_path / built.name
    shutil.copy(built, bad)
    manifest, _, _ = open_bundle(bad)
    victim = next(f for f in manifest.files if f.path.endswith("sarvtest_b-2.0-py3-none-any.whl"))
    _flip_byte(bad, victim.path)
    res = llmctl("bundle", "verify", str(bad), "--allowed-signers", str(kit.allowed_signers))
    assert res.returncode == 8
    assert (
        f"{victim.path}: sha256 " in res.stderr
        and f"does not match the manifest's {victim.sha256}" in res.stderr
    )
    actual = res.stderr.split(f"{victim.path}: sha256 ", 1)[1].split()[0]
    assert len(actual) == 64 and actual != victim.sha256

    load = llmctl(
        "bundle", "load", str(bad), "-i", str(kit.inventory), "--allowed-signers", str(kit.allowed_signers),
        "--work", str(tmp_path / "work"),
    )  # fmt: skip
    assert load.returncode == 8
    assert f"{victim.path}: sha256 {actual} does not match the manifest's {victim.sha256}" in load.stderr
    assert not (kit.inventory.parent / "group_vars").exists()


def test_a_foreign_or_broken_signature_is_refused(kit: Kit, built: Path, tmp_path: Path) -> None:
    res = llmctl("bundle", "verify", str(built), "--allowed-signers", str(kit.other_signers))
    assert res.returncode == 8
    assert "signature is not by a key in" in res.stderr

    # A manifest changed after signing (one hash rewritten), with the original signature.
    _, raw, sig = open_bundle(built)
    data = json.loads(raw)
    data["files"][0]["sha256"] = "0" * 64
    forged = tmp_path / "forged.bundle"
    with tarfile.open(built, "r:") as src, tarfile.open(forged, "w:") as dst:
        for member in src:
            blob = json.dumps(data).encode() if member.name == MANIFEST else None
            if blob is not None:
                member.size = len(blob)
                dst.addfile(member, io.BytesIO(blob))
            else:
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    assert sig == open_bundle(forged)[2]
    res = llmctl("bundle", "verify", str(forged), "--allowed-signers", str(kit.allowed_signers))
    assert res.returncode == 8
    assert "bad signature on the manifest" in res.stderr


def test_since_packs_only_what_changed(kit: Kit, built: Path, tmp_path: Path) -> None:
    extra = tmp_path / "adapter"
    extra.mkdir()
    (extra / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    subprocess.run("sha256sum adapter_model.safetensors > SHA256SUMS", shell=True, cwd=extra, check=True)
    newer = built.with_name("site-2.bundle")
    res = kit.create(newer, "--since", str(built), "--weights", f"sarv-tiny-lora-demo/none={extra}")
    assert res.returncode == 0, res.stderr
    manifest = Manifest.loads(open_bundle(newer)[1], str(newer))
    packed = {f.path for f in manifest.files if not f.in_base}
    # Only the new adapter, and what is rebuilt with new bytes each run (the Sarv wheel's and the
    # index's timestamps), is packed; the wheelhouse, packages, image and tiny model are the base's.
    assert {p for p in packed if p.startswith("models/")} == {
        "models/sarv-tiny-lora-demo/none/SHA256SUMS",
        "models/sarv-tiny-lora-demo/none/adapter_model.safetensors",
    }
    assert not any(p.startswith("images/") or p.endswith(".deb") or "sarvtest" in p for p in packed)
    assert manifest.base is not None and manifest.base.name == built.name
    assert newer.stat().st_size < built.stat().st_size / 4

    ok = llmctl("bundle", "verify", str(newer), "--allowed-signers", str(kit.allowed_signers))
    assert ok.returncode == 0, ok.stderr
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(newer, alone / newer.name)
    res = llmctl("bundle", "verify", str(alone / newer.name), "--allowed-signers", str(kit.allowed_signers))
    assert res.returncode == 8 and f"incremental on {built.name}, which is not at" in res.stderr
