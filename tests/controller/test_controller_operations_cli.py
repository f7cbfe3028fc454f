"""``llmctl scale|apply|cordon|uncordon|drain|events`` and ``status`` as a user runs them: real
subprocesses, sim replicas on a declared two-node GPU fleet of this host, SQLite state."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.fleets import gpu_fleet, llmctl_on_fleet
from fixtures.vllm import LlmctlEnv

_FILE = """\
name: web
model: sarv-tiny
engine: sim
replicas: {replicas}
---
- name: api
  model: sarv-tiny
  engine: sim
"""


@pytest.fixture
def env(tmp_path: Path) -> Iterator[LlmctlEnv]:
    with llmctl_on_fleet(tmp_path, gpu_fleet(nodes=2, gpus=2)) as e:
        yield e


def _write(tmp_path: Path, replicas: int) -> Path:
    path = tmp_path / "deployments.yaml"
    path.write_text(_FILE.format(replicas=replicas))
    return path


def test_apply_creates_then_changes_nothing_then_scales(env: LlmctlEnv, tmp_path: Path) -> None:
    path = _write(tmp_path, 1)
    dry = env.llmctl("apply", "-f", str(path), "--dry-run", check=True)
    assert dry.stdout.splitlines() == [
        "+ web: create (sarv-tiny, 1 replica(s), tp=1)",
        "+ api: create (sarv-tiny, 1 replica(s), tp=1)",
    ]
    assert env.status()["deployments"] == [], "a dry run changes nothing"
    env.llmctl("apply", "-f", str(path), check=True, timeout=180)
    before = env.replica_pids()
    again = env.llmctl("apply", "-f", str(path), check=True)
    assert again.stdout.splitlines() == ["= web: unchanged", "= api: unchanged"]
    assert env.replica_pids() == before

    path = _write(tmp_path, 2)
    diff = env.llmctl("apply", "-f", str(path), "--dry-run", "-o", "json", check=True)
    assert json.loads(diff.stdout)[0] == {
        "name": "web",
        "action": "scale",
        "fields": {"replicas": {"current": 1, "desired": 2}},
    }
    env.llmctl("apply", "-f", str(path), check=True, timeout=180)
    web = next(d for d in env.status()["deployments"] if d["name"] == "web")
    assert [r["state"] for r in web["replicas"]] == ["ready", "ready"]
    assert {r["node"] for r in web["replicas"]} == {"gpu-a", "gpu-b"}
    assert set(before) <= set(env.replica_pids()), "scaling kept the running replicas"
    pids = env.replica_pids()

    path.write_text(_FILE.format(replicas=2).replace("engine: sim\nreplicas", "engine: sim\ntp: 2\nreplicas"))
    dry = env.llmctl("apply", "-f", str(path), "--dry-run", check=True)
    assert dry.stdout.splitlines()[0] == "» web: tp 1 -> 2 (a canary rollout)"
    path.write_text(_FILE.format(replicas=3).replace("engine: sim\nreplicas", "engine: sim\ntp: 2\nreplicas"))
    refused = env.llmctl("apply", "-f", str(path))
    assert refused.returncode == 2
    assert "web changes replicas, tp at once; the replica counts scale and the rest" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert env.replica_pids() == pids, "nothing was applied"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name: web\nmodel: [unclosed\n", "is not valid YAML at line 3"),
        ("name: web\nmodel: sarv-tiny\nreplicas: -1\n", "document 1: replicas: Input should be greater"),
        ("---\nmodel: sarv-tiny\nengine: sim\n---\nmodel: sarv-tiny\nreplica: 2\n", "document 2: replica:"),
        ("- 3\n", "document 1: a deployment must be a mapping"),
        ("name: web\n", "document 1: model: field required"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_document_and_field(
    env: LlmctlEnv, tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    out = env.llmctl("apply", "-f", str(path))
    assert out.returncode == 2, out.stderr
    assert str(path) in out.stderr and message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr


def test_scale_cordon_drain_and_their_events(env: LlmctlEnv) -> None:
    env.llmctl("deploy", "sarv-tiny", "--name", "web", "--engine", "sim", check=True, timeout=180)
    assert "gpu-a: cordoned" in env.llmctl("cordon", "gpu-a", check=True).stdout
    out = env.llmctl("scale", "web", "4")
    assert out.returncode == 3, out.stderr
    assert "web: 1 of 4 replica(s) could not be placed and wait as pending" in out.stderr
    assert "cordoned, not considered: gpu-a" in out.stderr and "llmctl scale web 3" in out.stderr
    [web] = env.status()["deployments"]
    assert sorted(r["state"] for r in web["replicas"]) == ["pending", "ready", "ready", "ready"]
    assert web["events"][-1]["reason"] == "NoRoom"
    table = env.llmctl("status", check=True).stdout
    assert "Recent events" in table and "NoRoom" in table
    assert "node gpu-a: cordoned" in table

    env.llmctl("uncordon", "gpu-a", check=True)
    env.llmctl("scale", "web", "2", "--drain-timeout", "10s", check=True)
    [web] = env.status()["deployments"]
    assert [r["state"] for r in web["replicas"]] == ["ready", "ready"]

    drained = env.llmctl("drain", "gpu-b", "--timeout", "10s", check=True, timeout=180)
    assert "gpu-b: drained and cordoned" in drained.stdout
    [web] = env.status()["deployments"]
    assert {r["node"] for r in web["replicas"]} == {"gpu-a"}
    assert len(web["replicas"]) == 2

    events = json.loads(env.llmctl("events", "web", "-o", "json", check=True).stdout)
    reasons = [e["reason"] for e in events]
    assert reasons[0] == "Deployed"
    assert {"Scaled", "NoRoom", "ScaledDown", "Drained", "Stopped", "Replaced"} <= set(reasons)
    listing = env.llmctl("events", check=True).stdout
    assert "node/gpu-b" in listing and "Cordoned" in listing
    assert env.llmctl("events", "--since", "soon").returncode == 2
    audit = json.loads(env.llmctl("audit", "-o", "json", check=True).stdout)
    assert {"scale", "cordon", "uncordon", "drain"} <= {a["action"] for a in audit}
