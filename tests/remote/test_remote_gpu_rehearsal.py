"""A GPU deployment rehearsed on two container hosts with declared L4 GPUs, ``sim`` standing in for vLLM.

One plan with quantization auto, a LoRA adapter and a draft model goes down the launch path a GPU replica
takes: the variant's weights, the adapter and the draft verified and copied into each node's model cache,
the unit started on the node with the planned GPUs, the simulator (checking tp×pp, memory and variant as
vLLM would) serving through a real gateway, and an adapter added and removed live and routed by it.
What only a GPU host proves: CUDA, the container runtime's GPU hand-off and vLLM's real memory use.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.gateway import GatewayStarter, add_key, chat, gateway_factory, gateway_model_ids
from fixtures.testhosts import TestHost

from controlplane.controller.adapters import AdapterManager
from controlplane.spec import (
    DeploymentSpec,
    EngineKind,
    Fleet,
    LoraAdapter,
    Node,
    Quantization,
    SpeculativeConfig,
)
from controlplane.weights import write_manifest
from controlplane.weights.tiny import generate_tiny_model

__all__ = ["gateway_factory"]  # the fixture, used by name

pytestmark = [pytest.mark.ssh, pytest.mark.docker, pytest.mark.slow]

CACHE = "/var/lib/sarv/models"


def _adapter(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    write_manifest(path)
    return path


def _landed(host: TestHost, name: str) -> list[str]:
    """Verified copies in the node's cache: ``<cache>/<name>/<digest>`` directories with a manifest."""
    out = host.exec(f"ls -d {CACHE}/{name}/*/ 2>/dev/null || true").stdout.split()
    return [d.rstrip("/") for d in out if host.exec(f"test -s {d}/SHA256SUMS", check=False).returncode == 0]


def test_a_planned_gpu_deployment_with_adapters_and_draft_runs_on_the_rehearsal_fleet(
    remote_hosts: list[TestHost],
    remote_nodes: list[Node],
    wired: Callable[..., Any],
    gateway_factory: GatewayStarter,
    tmp_path: Path,
) -> None:
    from controlplane.fleet import discover_fleet
    from controlplane.remote import FabricConnector

    fleet = discover_fleet(
        Fleet(nodes=remote_nodes),
        connector=FabricConnector(key_filename=remote_hosts[0].key_path),
    )
    assert all(n.gpus and n.gpus[0].model == "L4" for n in fleet.nodes)  # from nvidia-smi
    w = wired(fleet)
    draft = generate_tiny_model(tmp_path / "draft")
    spec = DeploymentSpec(
        name="chat",
        model="sarv-tiny",
        replicas=2,
        engine=EngineKind.SIM,
        quantization=Quantization.AUTO,
        max_model_len=512,
        lora_adapters=[LoraAdapter(name="sql", source=str(_adapter(tmp_path / "sql")))],
        speculative=SpeculativeConfig(model=str(draft), num_speculative_tokens=3),
    )
    result = w.deployer.deploy(spec, timeout=240)
    assert sorted(r.node for r in result.replicas) == sorted(h.name for h in remote_hosts)  # anti-affinity
    for rec, host in ((r, next(h for h in remote_hosts if h.name == r.node)) for r in result.replicas):
        # The variant auto chose (the tiny model has one: none) is what was copied, verified, per node.
        [weights] = _landed(host, "sarv-tiny")
        [adapter] = _landed(host, "sarv-tiny-lora-sql")
        [landed_draft] = _landed(host, "sarv-tiny-draft")
        unit = host.exec(f"cat /etc/systemd/system/sarv-{rec.id}.service").stdout
        assert f'"--model" "{weights}"' in unit and f'"sql={adapter}"' in unit
        gpu = fleet.node(host.name).gpus[0]
        assert f'Environment="CUDA_VISIBLE_DEVICES={gpu.uuid or gpu.index}"' in unit
        assert '"--gpu-memory-mib" "23034"' in unit  # the L4's memory, for the stand-in's check
        assert landed_draft.startswith(f"{CACHE}/sarv-tiny-draft/")
        assert [(s.node, s.gpus) for s in rec.shards] == [(host.name, [0])]

    key = add_key(w.store)
    gw = gateway_factory(w.store)
    for model in ("chat", "sql"):
        resp = chat(gw.url, key, model)
        assert resp.status_code == 200, resp.text

    manager = AdapterManager(w.deployer)
    assert manager.add("chat", "docs", str(_adapter(tmp_path / "docs"))) == ["chat-0", "chat-1"]
    for host in remote_hosts:
        assert _landed(host, "sarv-tiny-lora-docs")
    assert "docs" in gateway_model_ids(gw.url, key, "docs", present=True)
    assert chat(gw.url, key, "docs").status_code == 200
    assert manager.remove("chat", "docs") == ["chat-0", "chat-1"]
    assert "docs" not in gateway_model_ids(gw.url, key, "docs", present=False)
    gone = chat(gw.url, key, "docs")
    assert gone.status_code == 404 and "docs" in gone.text
