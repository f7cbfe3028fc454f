"""``llmctl lora add|remove|list`` on running sim replicas, end to end through a real gateway.

The simulator implements vLLM's runtime adapter endpoints (enabled by VLLM_ALLOW_RUNTIME_LORA_UPDATING, which
the engine sets only for deployments with LoRA on); the gateway learns served names from the replica
records the add/remove updates.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fixtures.controller import llmctl_env
from fixtures.gateway import GatewayStarter, add_key, chat, gateway_factory, gateway_model_ids
from fixtures.vllm import LlmctlEnv

from controlplane.state import open_store
from controlplane.state.base import StateStore
from controlplane.weights import write_manifest

__all__ = ["gateway_factory", "llmctl_env"]  # the fixtures, used by name


def _adapter(path: Path, rank: int = 8) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    write_manifest(path)
    return path


@pytest.fixture
def env(llmctl_env: LlmctlEnv) -> LlmctlEnv:
    return llmctl_env


@pytest.fixture
def store(env: LlmctlEnv) -> Iterator[StateStore]:
    env.llmctl(
        "deploy",
        "sarv-tiny",
        "--engine",
        "sim",
        "--replicas",
        "2",
        "--engine-arg",
        "enable_lora=true",
        check=True,
    )
    s = open_store(env.env["SARV_STATE_URL"])
    yield s
    s.close()


def _cards(endpoint: str, engine_key: str | None) -> list[dict[str, str | None]]:
    """The replica's own model cards, asked with the deployment's engine key."""
    headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}
    return httpx.get(f"{endpoint}/v1/models", headers=headers, timeout=10).json()["data"]  # type: ignore[no-any-return]


def _served(endpoint: str, engine_key: str | None) -> dict[str, str | None]:
    return {m["id"]: m["parent"] for m in _cards(endpoint, engine_key)}


def test_add_route_remove_an_adapter_on_every_replica(
    env: LlmctlEnv, store: StateStore, gateway_factory: GatewayStarter, tmp_path: Path
) -> None:
    key = add_key(store)
    engine_key = env.engine_key("sarv-tiny")
    gw = gateway_factory(store)
    src = _adapter(tmp_path / "sql")
    out = env.llmctl("lora", "add", "sarv-tiny", "sql", "--source", str(src), check=True)
    assert "adapter sql loaded on sarv-tiny-0, sarv-tiny-1" in out.stdout
    for rec in store.list_replicas("sarv-tiny"):
        # vLLM's card: the parent is the base model
        assert _served(rec.endpoint, engine_key)["sql"] == "sarv-tiny"
        assert rec.adapters == ["sql"]
    record = store.get_deployment("sarv-tiny")
    assert record is not None and [a.name for a in record.spec.lora_adapters] == ["sql"]
    assert "sql" in env.llmctl("lora", "list", "sarv-tiny", check=True).stdout

    assert "sql" in gateway_model_ids(gw.url, key, "sql", present=True)
    resp = chat(gw.url, key, "sql")
    assert resp.status_code == 200, resp.text

    again = env.llmctl("lora", "add", "sarv-tiny", "sql", "--source", str(src))
    assert again.returncode == 2 and "already serves a model named 'sql'" in again.stderr

    out = env.llmctl("lora", "remove", "sarv-tiny", "sql", check=True)
    for rec in store.list_replicas("sarv-tiny"):
        assert "sql" not in _served(rec.endpoint, engine_key)
    assert "sql" not in gateway_model_ids(gw.url, key, "sql", present=False)
    record = store.get_deployment("sarv-tiny")
    assert record is not None and record.spec.lora_adapters == []
    missing = env.llmctl("lora", "remove", "sarv-tiny", "sql")
    assert missing.returncode != 0 and "has no adapter 'sql'" in missing.stderr


def test_a_replica_that_fails_the_add_rolls_it_back_on_the_others(
    env: LlmctlEnv, store: StateStore, tmp_path: Path
) -> None:
    replicas = {r.id: r for r in store.list_replicas("sarv-tiny")}
    pid = int(replicas["sarv-tiny-1"].handle["pid"])
    os.killpg(pid, signal.SIGKILL)  # the record still says ready: the load request finds nobody there
    out = env.llmctl("lora", "add", "sarv-tiny", "sql", "--source", str(_adapter(tmp_path / "sql")))
    assert out.returncode != 0
    assert "was unloaded from the others" in out.stderr and "Traceback" not in out.stderr
    assert "sql" not in _served(replicas["sarv-tiny-0"].endpoint, env.engine_key("sarv-tiny"))
    record = store.get_deployment("sarv-tiny")
    assert record is not None and record.spec.lora_adapters == []
    assert all(r.adapters == [] for r in store.list_replicas("sarv-tiny"))


def test_a_deployment_without_lora_refuses_an_add(env: LlmctlEnv, tmp_path: Path) -> None:
    env.llmctl("deploy", "sarv-tiny", "--engine", "sim", check=True)
    out = env.llmctl("lora", "add", "sarv-tiny", "sql", "--source", str(_adapter(tmp_path / "sql")))
    assert out.returncode == 2 and "was started without LoRA" in out.stderr
    [rec] = env.status()["deployments"][0]["replicas"]
    resp = httpx.post(
        f"{rec['endpoint']}/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": "/"},
        headers={"Authorization": f"Bearer {env.engine_key('sarv-tiny')}"},
    )
    assert resp.status_code == 404  # without the switch the engine has no such route, as vLLM


def test_deploy_copies_adapters_into_the_node_cache_and_serves_them_from_there(
    env: LlmctlEnv, tmp_path: Path
) -> None:
    src = _adapter(tmp_path / "sql")
    env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--lora-module", f"sql={src}", check=True)
    [landed] = [p.parent for p in env.home.rglob("adapter_config.json")]
    assert landed.parent.name == "sarv-tiny-lora-sql"
    assert (landed / "SHA256SUMS").read_text() == (src / "SHA256SUMS").read_text()
    [rec] = env.status()["deployments"][0]["replicas"]
    cards = {m["id"]: m for m in _cards(rec["endpoint"], env.engine_key("sarv-tiny"))}
    assert cards["sql"]["root"] == str(landed) and cards["sql"]["parent"] == "sarv-tiny"


def test_the_container_engine_mounts_adapters_and_draft_read_only_and_allows_runtime_loading() -> None:
    from controlplane.engines.base import ReplicaContext
    from controlplane.engines.vllm import VllmEngine
    from controlplane.spec import DeploymentSpec, LoraAdapter, Shard, SpeculativeConfig

    spec = DeploymentSpec(
        name="chat",
        model="llama-3-8b",
        lora_adapters=[LoraAdapter(name="sql", source="/cache/m-lora-sql/abc")],
        speculative=SpeculativeConfig(model="/cache/m-draft/def", num_speculative_tokens=3),
    )
    ctx = ReplicaContext(
        replica_id="chat-0",
        spec=spec,
        served_model_name="chat",
        model_dir=Path("/cache/m/123"),
        port=9000,
        shards=[Shard(node="g1", gpus=[0], pp_rank=0)],
        gpu_ids=["0"],
    )
    argv = VllmEngine(image="vllm/vllm-openai:test").build(ctx).argv
    pairs = list(itertools.pairwise(argv))
    assert ("--volume", "/cache/m-lora-sql/abc:/cache/m-lora-sql/abc:ro,z") in pairs
    assert ("--volume", "/cache/m-draft/def:/cache/m-draft/def:ro,z") in pairs
    assert ("--env", "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True") in pairs
    assert ("--lora-modules", "sql=/cache/m-lora-sql/abc") in pairs
    plain = (
        VllmEngine(image="i").build(ctx.model_copy(update={"spec": DeploymentSpec(name="c", model="m")})).argv
    )
    assert not any("LORA" in a for a in plain) and "--enable-lora" not in plain
